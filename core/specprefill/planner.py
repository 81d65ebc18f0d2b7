"""The planner: decide, before any scoring, whether SpecPrefill runs.

Statuses are the strings of the SpecPrefill guide (the spec this project
implements), reported as ``timings.specprefill``.  The break-even test
compares the estimated dense prefill with scoring plus the sparse prefill of
the tokens expected to be kept, from cost functions fitted to measurements on
this machine (core.specprefill.cost_model), never constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.policies import PrefillPolicy
from core.results import Status
from core.specprefill.content import ContentKind
from core.specprefill.cost_model import Costs, Work, estimate
from core.specprefill.guard import GuardVerdict


@dataclass(slots=True, frozen=True)
class Plan:
    status: Status
    reason: str
    score: bool
    protected: tuple[tuple[int, int], ...] = ()
    kind: ContentKind = ContentKind.PROSE  # of the tokens free to drop


def plan(work: Work, policy: PrefillPolicy, guard: GuardVerdict, costs: Costs) -> Plan:
    if not policy.enabled:
        return Plan(Status.DISABLED, "specprefill disabled by configuration", False)
    if work.n_select < policy.min_tokens:
        return Plan(Status.SKIPPED_MIN_TOKENS,
                    f"{work.n_select} new tokens < min_tokens {policy.min_tokens}", False)
    if guard.triggered and policy.guard_mode == "skip":
        return Plan(Status.SKIPPED_TOOL_GUARD, guard.reason, False)
    if policy.break_even and work.n_protected >= work.n_select:
        # scoring would only confirm what the guard decided: no token is free to drop
        return Plan(Status.SKIPPED_BREAK_EVEN, f"all {work.n_select} new tokens are kept dense ({guard.kept}): "
                    "nothing to drop", False, kind=work.kind)
    if policy.break_even and costs.calibrated:
        est = estimate(work, costs)
        if est.saved_s < est.scoring_s * policy.safety:
            return Plan(Status.SKIPPED_BREAK_EVEN,
                        f"saves ~{est.saved_s:.2f}s (dense ~{est.dense_s:.2f}s, sparse ~{est.sparse_s:.2f}s "
                        f"for ~{est.kept} kept of {work.kind}) < scoring ~{est.scoring_s:.2f}s x {policy.safety}",
                        False, kind=work.kind)
    protected = guard.spans
    reason = f"scoring; kept dense: {guard.kept}" if protected else "scoring"
    return Plan(Status.ACTIVE, reason, True, protected, work.kind)
