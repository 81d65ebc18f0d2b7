"""The planner: decide, before any scoring, whether SpecPrefill runs.

Statuses are the strings of the SpecPrefill guide (the spec this project
implements), reported as ``timings.specprefill``.  The break-even test uses
throughputs measured on this machine (calibrated at load, then running
averages of every real prefill), never constants.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from core.config import PrefillPolicy
from core.guard import GuardVerdict


class Status(enum.StrEnum):
    DISABLED = "disabled"
    SKIPPED_MIN_TOKENS = "skipped_min_tokens"
    SKIPPED_TOOL_GUARD = "skipped_tool_guard"
    SKIPPED_BREAK_EVEN = "skipped_break_even"
    KEPT_ALL = "kept_all"
    ACTIVE = "active"


@dataclass(slots=True)
class Throughput:
    """Exponential running averages of measured speeds (tokens/s, seconds/step)."""

    speculator_prefill_tps: float = 0.0
    speculator_step_s: float = 0.0
    target_prefill_tps: float = 0.0
    kept_ratio: float = 0.3  # prior until the first real selection is seen
    alpha: float = 0.3

    def _mix(self, old: float, new: float) -> float:
        return new if old <= 0.0 else (1 - self.alpha) * old + self.alpha * new

    def observe_speculator_prefill(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= 16 and seconds > 0:
            self.speculator_prefill_tps = self._mix(self.speculator_prefill_tps, n_tokens / seconds)

    def observe_speculator_step(self, seconds: float) -> None:
        if seconds > 0:
            self.speculator_step_s = self._mix(self.speculator_step_s, seconds)

    def observe_target_prefill(self, n_tokens: int, seconds: float) -> None:
        if n_tokens >= 16 and seconds > 0:
            self.target_prefill_tps = self._mix(self.target_prefill_tps, n_tokens / seconds)

    def observe_kept(self, ratio: float) -> None:
        self.kept_ratio = self._mix(self.kept_ratio, ratio)

    @property
    def calibrated(self) -> bool:
        return self.speculator_prefill_tps > 0 and self.target_prefill_tps > 0


@dataclass(slots=True, frozen=True)
class BreakEven:
    scoring_s: float
    saved_s: float
    worth_it: bool


def break_even(n_score: int, n_select: int, lookahead: int, speeds: Throughput,
               safety: float) -> BreakEven:
    """Scoring costs the speculator's prefill of ``n_score`` tokens plus lookahead
    steps; it saves the target's prefill of the ``n_select`` tokens expected to drop."""
    scoring = n_score / speeds.speculator_prefill_tps + (lookahead + 1) * speeds.speculator_step_s
    saved = n_select * (1.0 - speeds.kept_ratio) / speeds.target_prefill_tps
    return BreakEven(scoring, saved, saved >= scoring * safety)


@dataclass(slots=True, frozen=True)
class Plan:
    status: Status
    reason: str
    score: bool
    protected: tuple[tuple[int, int], ...] = ()


def plan(n_select: int, n_score: int, policy: PrefillPolicy, guard: GuardVerdict,
         speeds: Throughput) -> Plan:
    """``n_select``: tokens eligible for sparsification (the new delta);
    ``n_score``: tokens the speculator must newly prefill to score them."""
    if not policy.enabled:
        return Plan(Status.DISABLED, "specprefill disabled by configuration", False)
    if n_select < policy.min_tokens:
        return Plan(Status.SKIPPED_MIN_TOKENS,
                    f"{n_select} new tokens < min_tokens {policy.min_tokens}", False)
    if guard.triggered and policy.guard_mode == "skip":
        return Plan(Status.SKIPPED_TOOL_GUARD, guard.reason, False)
    protected = guard.spans
    if policy.break_even and speeds.calibrated:
        estimate = break_even(n_score, n_select, policy.lookahead, speeds, policy.safety)
        if not estimate.worth_it:
            return Plan(Status.SKIPPED_BREAK_EVEN,
                        f"saves ~{estimate.saved_s:.2f}s < scoring ~{estimate.scoring_s:.2f}s"
                        f" x {policy.safety}", False)
    reason = f"scoring; kept dense: {guard.kept}" if protected else "scoring"
    return Plan(Status.ACTIVE, reason, True, protected)
