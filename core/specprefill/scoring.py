"""Token importance from captured attention rows (pure numpy).

The SpecPrefill guide's definition (aggregation ``max``): max over heads, then
max over layers, then mean over the lookahead steps; optional mean-pool
smoothing along tokens; min-max normalization to [0, 1]; a structural boost
of the first and last tokens.

GemFilter's (Shi et al., 2024) reads one *filter layer* instead -- the last
layer of a scorer cut to its first r blocks -- with the heads summed
(``filter-sum``) or maxed (``filter-max``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

AGGREGATIONS = ("max", "filter-sum", "filter-max")


def reduce_step(step: np.ndarray, agg: str = "max") -> np.ndarray:
    """One step [n_layers, n_head, n_keys] -> [n_keys]."""
    if agg == "max":
        return step.max(axis=1).max(axis=0)
    if agg == "filter-sum":
        return step[-1].sum(axis=0)
    if agg == "filter-max":
        return step[-1].max(axis=0)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {agg!r}")


def reduce_steps(steps: Sequence[np.ndarray], n_tokens: int, agg: str = "max") -> np.ndarray:
    """Steps of shape [n_layers, n_head, n_keys] -> one score per prompt token.

    Later steps see more keys (their own lookahead tokens); only the first
    ``n_tokens`` columns (the prompt) are scored.
    """
    if not steps:
        return np.ones(n_tokens, dtype=np.float32)
    per_step = []
    for step in steps:
        if step.ndim != 3 or step.shape[2] < n_tokens:
            raise ValueError(f"step of shape {step.shape} does not cover {n_tokens} tokens")
        per_step.append(reduce_step(step[:, :, :n_tokens], agg))
    return np.mean(per_step, axis=0).astype(np.float32)


def mean_pool(scores: np.ndarray, kernel: int) -> np.ndarray:
    """Centered moving average; edges average over the cells that exist."""
    if kernel <= 1 or scores.size == 0:
        return scores.astype(np.float32, copy=True)
    n, half = scores.size, kernel // 2
    csum = np.concatenate(([0.0], np.cumsum(scores, dtype=np.float64)))
    lo = np.clip(np.arange(n) - half, 0, n)
    hi = np.clip(np.arange(n) + (kernel - half), 0, n)
    return ((csum[hi] - csum[lo]) / (hi - lo)).astype(np.float32)


def normalize(scores: np.ndarray) -> np.ndarray:
    """Min-max to [0, 1]; a constant vector carries no ranking and maps to ones."""
    if scores.size == 0:
        return scores.astype(np.float32, copy=True)
    lo, hi = float(scores.min()), float(scores.max())
    if hi - lo <= 1e-12:
        return np.ones_like(scores, dtype=np.float32)
    return ((scores - lo) / (hi - lo)).astype(np.float32)


def boost(scores: np.ndarray, first_n: int, first_mult: float,
          last_n: int, last_mult: float) -> np.ndarray:
    out = scores.astype(np.float32, copy=True)
    if first_n > 0:
        out[:first_n] *= first_mult
    if last_n > 0:
        out[-last_n:] *= last_mult
    return out


def importance(steps: Sequence[np.ndarray], n_tokens: int, pool_kernel: int,
               first_n: int, first_mult: float, last_n: int, last_mult: float, agg: str = "max") -> np.ndarray:
    raw = reduce_steps(steps, n_tokens, agg)
    return boost(normalize(mean_pool(raw, pool_kernel)), first_n, first_mult, last_n, last_mult)
