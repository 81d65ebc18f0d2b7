"""SpecAttn policy math (pure numpy): sorting-free top-p selection, the
monotone KL layer map between draft and target attention, and the one KV
selection a verification step attends through.

llama.cpp applies one attention mask to every layer of a ubatch, so the
sparse view here is a *single* cell selection for all target layers (the
paper selects per layer and keeps the first 2 layers dense).  It is built from
the draft layers the map points to: each draft layer's head-averaged attention
row, weighted by how many target layers map to it, then top-p, then the union
over the gamma draft steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from core.spans import runs


def top_p_threshold(attn: np.ndarray, p: float, rounds: int = 10, scale: str = "log",
                    octaves: float = 32.0) -> np.ndarray:
    """Per row, a threshold t in [0, max(a)] such that the cells with a >= t hold
    at least ``p`` of the row's mass, found by ``rounds`` of bisection (no sort).

    ``scale="linear"`` bisects t itself, as the paper describes: 10 rounds resolve
    t only to max/1024, so on a long row with an attention sink (max ~ 0.5, most
    cells ~ 1/n) the search cannot go below the sink's scale and keeps every cell.
    ``scale="log"`` (the default) bisects log2(t) over the ``octaves`` below max,
    so 10 rounds resolve t to 2^(octaves/1024) ~ 2% at any row length; rows whose
    threshold lies below that range keep every cell (those cells hold < n * max * 2^-32).

    ``attn``: [..., n] non-negative.  Returns [...] thresholds.
    """
    if not 0.0 < p <= 1.0:
        raise ValueError(f"p must be in (0, 1], got {p}")
    a = np.asarray(attn, dtype=np.float64)
    target = p * a.sum(axis=-1, keepdims=True)
    top = a.max(axis=-1, keepdims=True)

    def enough(t: np.ndarray) -> np.ndarray:
        return np.asarray(np.where(a >= t, a, 0.0).sum(axis=-1, keepdims=True) >= target)

    if scale == "linear":
        lo, hi = np.zeros_like(top), top
        to_t = lambda x: x  # noqa: E731
    elif scale == "log":
        with np.errstate(divide="ignore"):
            hi = np.log2(np.where(top > 0, top, 1.0))
        lo = hi - octaves
        to_t = np.exp2
    else:
        raise ValueError(f"scale must be 'log' or 'linear', got {scale!r}")
    for _ in range(rounds):
        mid = (lo + hi) / 2
        ok = enough(to_t(mid))
        lo = np.where(ok, mid, lo)  # mid still keeps enough: try a higher threshold
        hi = np.where(ok, hi, mid)
    t = to_t(lo)
    return np.where(enough(t) & (top > 0), t, 0.0)[..., 0]


def top_p_mask(attn: np.ndarray, p: float, rounds: int = 10, scale: str = "log") -> np.ndarray:
    """Boolean mask of the selected cells: a >= threshold (mass >= p guaranteed)."""
    a = np.asarray(attn)
    return np.asarray(a >= top_p_threshold(a, p, rounds, scale)[..., None])


def top_p_mask_sorted(attn: np.ndarray, p: float) -> np.ndarray:
    """Reference: the smallest set by descending weight whose mass >= p (ties kept whole)."""
    a = np.asarray(attn, dtype=np.float64)
    order = np.sort(a, axis=-1)[..., ::-1]
    csum = np.cumsum(order, axis=-1)
    k = (csum < p * a.sum(axis=-1, keepdims=True) - 1e-12).sum(axis=-1)
    cut = np.take_along_axis(order, np.minimum(k, a.shape[-1] - 1)[..., None], axis=-1)
    return np.asarray(a >= cut)


def kl_similarity(target: np.ndarray, draft: np.ndarray, eps: float = 1e-9) -> np.ndarray:
    """S[i, j] = -KL(A_target_j || A_draft_i) for per-layer distributions.

    ``target``: [m, n] and ``draft``: [d, n], one attention distribution per layer
    (rows are renormalized).  Returns [d, m].
    """
    t = np.asarray(target, dtype=np.float64) + eps
    d = np.asarray(draft, dtype=np.float64) + eps
    t /= t.sum(axis=1, keepdims=True)
    d /= d.sum(axis=1, keepdims=True)
    cross = t @ np.log(d).T  # [m, d]: sum_k t_jk log d_ik
    entropy = (t * np.log(t)).sum(axis=1, keepdims=True)  # [m, 1]
    return -(entropy - cross).T


def monotone_layer_map(similarity: np.ndarray) -> np.ndarray:
    """Non-decreasing f: target layer j -> draft layer i maximizing sum_j S[f(j), j].

    Dynamic programming over (target layer, draft layer): best[j, i] is the best
    total for target layers 0..j with f(j) = i.  ``similarity``: [d, m].
    """
    s = np.asarray(similarity, dtype=np.float64)
    n_draft, n_target = s.shape
    best = np.empty((n_target, n_draft))
    back = np.zeros((n_target, n_draft), dtype=np.int64)
    best[0] = s[:, 0]
    for j in range(1, n_target):
        # f(j-1) <= f(j): the best predecessor of draft layer i is the argmax of best[j-1, :i+1]
        arg = np.zeros(n_draft, dtype=np.int64)
        for i in range(1, n_draft):
            arg[i] = i if best[j - 1, i] > best[j - 1, arg[i - 1]] else arg[i - 1]
        best[j] = best[j - 1, arg] + s[:, j]
        back[j] = arg
    mapping = np.empty(n_target, dtype=np.int64)
    mapping[-1] = int(np.argmax(best[-1]))
    for j in range(n_target - 1, 0, -1):
        mapping[j - 1] = back[j, mapping[j]]
    return mapping


def proportional_map(n_target: int, n_draft: int) -> np.ndarray:
    """The layer map used before ``specgate calibrate`` has run: relative depth."""
    if n_target == 1:
        return np.zeros(1, dtype=np.int64)
    return np.rint(np.arange(n_target) * (n_draft - 1) / (n_target - 1)).astype(np.int64)


def layer_weights(layer_map: np.ndarray, n_draft: int, skip_first: int = 0) -> np.ndarray:
    """How many target layers (from ``skip_first`` on) point at each draft layer."""
    return np.bincount(np.asarray(layer_map)[skip_first:], minlength=n_draft).astype(np.float64)


def step_scores(step: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """One draft step's capture [n_layer, n_head, n_keys] -> per-key weights [n_keys]:
    heads averaged (still a distribution per layer), layers mixed by ``weights``."""
    per_layer = np.asarray(step, dtype=np.float64).mean(axis=1)
    return np.asarray(weights @ per_layer / weights.sum())


def select_cells(steps: list[np.ndarray], weights: np.ndarray, p: float, n_cells: int,
                 keep_first: int = 4, rounds: int = 10) -> np.ndarray:
    """Boolean mask over the first ``n_cells`` keys: the union over draft steps of each
    step's top-p set, plus the first ``keep_first`` (attention sinks) and the last key."""
    mask = np.zeros(n_cells, dtype=bool)
    for step in steps:
        scores = step_scores(step[..., :n_cells], weights)
        mask[: scores.size] |= top_p_mask(scores, p, rounds)
    mask[:keep_first] = True
    if n_cells:
        mask[-1] = True
    return mask


@dataclass(slots=True, frozen=True)
class SparseVerify:
    """SpecAttn's view policy: top-p mass ``p`` over draft layers mixed by ``weights``."""

    weights: np.ndarray
    p: float
    keep_first: int = 4


def view_spans(sparse: SparseVerify, steps: list[np.ndarray], positions: list[int],
               tpos: int) -> tuple[list[tuple[int, int]], int]:
    """Target position spans of the selected cells, and their count.  The verify batch
    continues the view, so the newest cell is always in it (and the first, a sink)."""
    pos = np.asarray(positions, dtype=np.int64)
    mask = select_cells(steps, sparse.weights, sparse.p, pos.size, sparse.keep_first)
    chosen = pos[mask]
    valid = pos[pos >= 0]
    chosen = np.unique(np.concatenate([chosen[chosen >= 0], [valid.min(), tpos - 1]]))
    return runs(chosen), int(chosen.size)
