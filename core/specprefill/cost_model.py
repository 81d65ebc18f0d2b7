"""What prefills cost on this machine, learned from measuring them (pure numpy).

One model's cost to decode ``m`` new tokens after ``c`` cells already in its
KV cache, in ``calls`` llama_decode calls, is

    seconds = a*m + b*m*(c + (m-1)/2) + d*calls

``a`` is the weights (a matmul per token), ``b`` attention over the context (it
is what makes an 8K prompt cost more than twice a 4K one: each token attends to
every cell before it, or to at most ``span`` cells in a windowed scoring prefill,
where the sum is :func:`attended`'s), ``d`` the per-call overhead that makes many
small sparse-prefill runs dearer than one batch.  The three are refitted by least
squares on relative error over recent measurements: the calibration at load,
then every real prefill (one-token lookahead steps are fitted apart).  A short calibration prompt cannot
see attention, so the fit is pulled gently toward a prior for ``b`` (attention
as costly as the weights at ``PRIOR_HALF_CONTEXT`` cells); real long prompts
overrule it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from core.specprefill.content import ContentKind

PRIOR_HALF_CONTEXT = 4096  # cells at which attention costs as much as the weights, before measuring
PRIOR_WEIGHT = 0.05  # pull toward the prior, relative to one measurement
# share of sparsifiable tokens kept per kind of content, until selections of that kind are seen
# (measured at mass 0.85 on the real pair: logs and prose 7-20%, source code 28-39%)
PRIOR_KEPT = {ContentKind.CODE: 0.35, ContentKind.LOGS: 0.12, ContentKind.PROSE: 0.15}
PRIOR_RUN_TOKENS = 64.0  # kept tokens per contiguous run, until selections are seen
SLOW_SAMPLE = 1.25  # a measurement this much slower than the fit predicts is suspected of contention
MOVE_ALPHA = 0.5  # weight of a sparse prefill's timed moves against what was known of moves before


def attended(m: int, c: int, span: int = 0) -> float:
    """Cells the ``m`` new tokens attend to in all, after ``c`` cells: each sees those before
    it, or at most ``span`` of them when a window bounds attention (0: unbounded)."""
    if not span or c + m - 1 <= span:
        return m * (c + (m - 1) / 2)
    k = min(m, max(0, span - c))  # the first k tokens still see fewer than span cells
    return k * (c + (k - 1) / 2) + (m - k) * span


def features(m: int, c: int, calls: int, span: int = 0) -> np.ndarray:
    return np.array([m, attended(m, c, span), calls], dtype=np.float64)


@dataclass(slots=True)
class PrefillCost:
    """One model's cost function, fitted from ``(m, c, calls, seconds)`` measurements."""

    coef: np.ndarray = field(default_factory=lambda: np.zeros(3))  # a, b, d
    # one K-shift: llama.cpp re-rotating every cell of the context's K cache after a cell moved
    # (each run of an original-position sparse prefill after the first); measured at start-up
    shift_s: float = 0.0
    # or moving only the cell's position label (core.llama.context.Seq.move): through the
    # sequence's saved state, seconds per cell the sequence holds; where slots share cells,
    # through the scratch sequence, ``move_s`` a move whatever the sequence holds.  0 = not
    # measured: moves are then preferred, being exact; inf = the context cannot move labels
    move_s_per_cell: float = 0.0
    move_s: float = 0.0
    samples: deque[tuple[np.ndarray, float]] = field(default_factory=lambda: deque(maxlen=48))

    @property
    def fitted(self) -> bool:
        return bool(self.coef[0] > 0)

    def seconds(self, m: int, c: int = 0, calls: int = 1, span: int = 0) -> float:
        return float(features(m, c, calls, span) @ self.coef) if m > 0 else 0.0

    def relabels(self, cells: int) -> bool:
        """Whether a bridge over a sequence of ``cells`` cells moves a label, not K."""
        return cells > 0 and self._move_s(cells) <= self.shift_s

    def _move_s(self, cells: int) -> float:
        return self.move_s + self.move_s_per_cell * cells

    def bridge_s(self, cells: int) -> float:
        """One bridge (a moved cell) in a sequence of ``cells`` cells, the cheaper way."""
        return self._move_s(cells) if self.relabels(cells) else self.shift_s

    def sparse_seconds(self, m: int, c: int, runs: int) -> float:
        """An original-position sparse prefill of ``m`` tokens in ``runs`` runs: every run
        after the first is a pass and a bridge."""
        return self.seconds(m, c, runs) + max(0, runs - 1) * self.bridge_s(c + m // 2)

    def bridge_tokens(self, c: int) -> int:
        """The longest gap between two kept runs that costs less to prefill (after ``c``
        cells) than the run it saves: a pass's overhead and a bridge."""
        a, b, d = self.coef
        per_token = a + b * c
        return int((d + self.bridge_s(c)) / per_token) if per_token > 0 else 0

    def observe_moves(self, count: int, cells: int, seconds: float) -> None:
        """``count`` label moves timed in a sequence of about ``cells`` cells: start-up timed
        one in 130 cells, and a move through the saved state copies the whole sequence, so
        what it costs at depth is learned from the moves made there."""
        if count <= 0 or seconds <= 0 or not math.isfinite(self.move_s_per_cell):
            return
        per_move = seconds / count
        if self.move_s_per_cell > 0 and cells > 0:  # private cells: the copy is per cell
            self.move_s_per_cell += MOVE_ALPHA * (per_move / cells - self.move_s_per_cell)
        elif self.move_s > 0:  # through the scratch sequence: per move, at any depth
            self.move_s += MOVE_ALPHA * (per_move - self.move_s)

    def observe(self, m: int, c: int, calls: int, seconds: float, span: int = 0) -> None:
        if m >= 1 and seconds > 0:
            self.samples.append((features(m, c, calls, span), seconds))
            self.coef = fit(list(self.samples))


def fit(samples: list[tuple[np.ndarray, float]]) -> np.ndarray:
    """Non-negative least squares on relative error, with a weak prior row per coefficient.

    Other load on the machine only ever slows a measurement down, so a sample much
    slower than the fit predicts is down-weighted and the fit repeated: one prefill
    that shared the cores with something else must not teach the planner that
    scoring is dear."""
    x = np.array([f for f, _ in samples])
    y = np.array([s for _, s in samples])
    weights = np.ones(len(y))
    coef = _solve(x, y, weights)
    for _ in range(2):
        slow = y / np.maximum(x @ coef, 1e-12)
        weights = np.where(slow > SLOW_SAMPLE, (SLOW_SAMPLE / slow) ** 4, 1.0)
        coef = _solve(x, y, weights)
    return coef


def _solve(x: np.ndarray, y: np.ndarray, weights: np.ndarray) -> np.ndarray:
    per_token = float(np.median(y / x[:, 0]))  # a rough a, which scales the prior
    prior = np.array([per_token, per_token / PRIOR_HALF_CONTEXT, 0.0])
    scale = np.array([per_token, per_token / PRIOR_HALF_CONTEXT, per_token])  # makes the prior rows unitless
    rows = np.vstack([x * (weights / y)[:, None], np.diag(PRIOR_WEIGHT / scale)])
    target = np.concatenate([weights, PRIOR_WEIGHT * prior / scale])
    free = np.ones(3, dtype=bool)
    coef = np.zeros(3)
    while free.any():  # drop a coefficient that goes negative and solve again
        sol, *_ = np.linalg.lstsq(rows[:, free], target, rcond=None)
        if (sol >= 0).all():
            coef[free] = sol
            break
        free[np.flatnonzero(free)[int(np.argmin(sol))]] = False
    return coef


@dataclass(slots=True)
class Costs:
    """Both models' prefill cost functions, the speculator's one-token steps (a separate
    regime: memory-bound, with the graph overhead of a tiny batch, so they would bias a
    prefill fit), and what selections have kept so far."""

    target: PrefillCost = field(default_factory=PrefillCost)
    speculator: PrefillCost = field(default_factory=PrefillCost)
    speculator_step: PrefillCost = field(default_factory=PrefillCost)
    kept_ratios: dict[ContentKind, float] = field(default_factory=lambda: dict(PRIOR_KEPT))  # of free tokens
    run_tokens: float = PRIOR_RUN_TOKENS
    alpha: float = 0.3

    @property
    def calibrated(self) -> bool:
        return self.target.fitted and self.speculator.fitted

    def kept_ratio(self, kind: ContentKind = ContentKind.PROSE) -> float:
        return self.kept_ratios[kind]

    def observe_selection(self, n_free: int, n_free_kept: int, n_kept: int, n_runs: int,
                          kind: ContentKind = ContentKind.PROSE) -> None:
        if n_free > 0:
            self.kept_ratios[kind] += self.alpha * (n_free_kept / n_free - self.kept_ratios[kind])
        if n_runs > 0:
            self.run_tokens += self.alpha * (n_kept / n_runs - self.run_tokens)


@dataclass(slots=True, frozen=True)
class Work:
    """One turn's prefill work, as the planner sees it before scoring."""

    n_select: int  # new target tokens, all eligible for sparsification
    n_protected: int  # of those, the ones the guard keeps dense
    target_cached: int  # cells already in the target's cache
    n_score: int  # tokens the speculator must prefill to score (its backlog included)
    speculator_cached: int  # cells those attend to, besides themselves
    lookahead: int
    n_batch: int
    compact: bool  # compact positions decode the kept tokens in full batches; original, run by run
    n_rebuild: int = 0  # the target's cells the speculator re-prefills first, to mirror it
    rebuild_runs: int = 0  # the contiguous runs those form
    kind: ContentKind = ContentKind.PROSE  # of the tokens free to drop: what share selection keeps depends on it
    speculator_span: int = 0  # the most cells a scoring prefill token attends to (a window); 0 = all


@dataclass(slots=True, frozen=True)
class Estimate:
    dense_s: float
    sparse_s: float
    scoring_s: float
    kept: int

    @property
    def saved_s(self) -> float:
        return self.dense_s - self.sparse_s


def _calls(n: int, n_batch: int) -> int:
    return max(1, -(-n // n_batch))


def estimate(work: Work, costs: Costs) -> Estimate:
    """Dense prefill, sparse prefill of the expected kept tokens, and scoring, in seconds."""
    free = max(0, work.n_select - work.n_protected)
    kept = min(work.n_select, work.n_protected + round(costs.kept_ratio(work.kind) * free))
    dense = costs.target.seconds(work.n_select, work.target_cached, _calls(work.n_select, work.n_batch))
    runs = _calls(kept, work.n_batch) if work.compact else max(1, round(kept / costs.run_tokens))
    if kept == work.n_select:  # nothing dropped: the prefill is the dense one, whatever runs selections form
        sparse = dense
    elif work.compact:
        sparse = costs.target.seconds(kept, work.target_cached, runs)
    else:
        sparse = costs.target.sparse_seconds(kept, work.target_cached, runs)
    # the speculator prefills all but the last token, then decodes it and the lookahead one by one
    n_prefill, n_context = max(0, work.n_score - 1), work.speculator_cached + work.n_score
    scoring = (costs.speculator.sparse_seconds(work.n_rebuild, 0, work.rebuild_runs)
               + costs.speculator.seconds(n_prefill, work.speculator_cached, _calls(n_prefill, work.n_batch),
                                          work.speculator_span)
               + (work.lookahead + 1) * costs.speculator_step.seconds(1, n_context))
    return Estimate(dense, sparse, scoring, kept)
