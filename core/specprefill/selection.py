"""Chunk selection policy over per-token scores (pure numpy).

Tokens are grouped into contiguous chunks; chunks are ranked by mean score and
kept either until their cumulative share of the total score reaches ``mass``
(``mass`` mode) or up to a fixed fraction of chunks (``chunk`` mode).  The
first/last few tokens and any protected spans are always kept; ``max_keep``
then drops whole chunks, lowest score first.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import numpy as np

from core.policies import Selection
from core.specprefill.lines import Lines, focus, widen


def chunk_means(scores: np.ndarray, chunk: int) -> np.ndarray:
    n = scores.size
    n_chunks = math.ceil(n / chunk)
    padded = np.zeros(n_chunks * chunk, dtype=np.float64)
    padded[:n] = scores
    counts = np.full(n_chunks, chunk, dtype=np.float64)
    if n % chunk:
        counts[-1] = n % chunk
    return (padded.reshape(n_chunks, chunk).sum(axis=1) / counts).astype(np.float32)


def _ranked(chunk_scores: np.ndarray) -> np.ndarray:
    # stable sort: equal scores keep the earlier chunk first, so results are deterministic
    return np.argsort(-chunk_scores, kind="stable")


def select_by_mass(chunk_scores: np.ndarray, mass: float) -> np.ndarray:
    """Boolean chunk mask: highest chunks until their share of the total >= mass."""
    keep = np.zeros(chunk_scores.size, dtype=bool)
    total = float(chunk_scores.sum())
    if chunk_scores.size == 0:
        return keep
    if total <= 0.0:
        keep[:] = True
        return keep
    order = _ranked(chunk_scores)
    cumulative = np.cumsum(chunk_scores[order]) / total
    n_keep = int(np.searchsorted(cumulative, mass - 1e-9) + 1)
    keep[order[: min(n_keep, order.size)]] = True
    return keep


def select_by_fraction(chunk_scores: np.ndarray, fraction: float) -> np.ndarray:
    keep = np.zeros(chunk_scores.size, dtype=bool)
    n_keep = max(1, math.ceil(chunk_scores.size * fraction)) if chunk_scores.size else 0
    keep[_ranked(chunk_scores)[:n_keep]] = True
    return keep


def cap_chunks(chunk_mask: np.ndarray, chunk_scores: np.ndarray, chunk: int,
               forced: np.ndarray, max_keep: int) -> np.ndarray:
    """Drop kept chunks, lowest score first, until kept tokens (forced included) <= max_keep."""
    if max_keep <= 0:
        return chunk_mask
    mask = chunk_mask.copy()
    n = forced.size

    def kept() -> int:
        return int((np.repeat(mask, chunk)[:n] | forced).sum())

    for c in _ranked(chunk_scores)[::-1]:
        if kept() <= max_keep:
            break
        mask[c] = False
    return mask


def forced_mask(n_tokens: int, keep_first: int, keep_last: int,
                spans: Iterable[tuple[int, int]] = ()) -> np.ndarray:
    forced = np.zeros(n_tokens, dtype=bool)
    forced[: min(keep_first, n_tokens)] = True
    if keep_last > 0:
        forced[-keep_last:] = True
    for start, end in spans:
        forced[max(0, start): min(n_tokens, end)] = True
    return forced


def select_tokens(scores: np.ndarray, params: Selection, protected: Iterable[tuple[int, int]] = (),
                  lines: Lines | None = None, code: bool = False) -> np.ndarray:
    """Sorted indices of the tokens to prefill into the target; with ``lines`` (the tokens'
    lines, core.specprefill.lines) widened to whole lines and code blocks as ``params`` asks,
    and for source code (``code``) to its skeleton."""
    n, chunk = scores.size, params.chunk_size
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    forced = forced_mask(n, params.keep_first, params.keep_last, protected)
    means = chunk_means(scores, chunk)
    if params.select_mode == "mass":
        chunk_mask = select_by_mass(means, params.mass)
    else:
        chunk_mask = select_by_fraction(means, params.keep_fraction)
    chunk_mask = cap_chunks(chunk_mask, means, chunk, forced, params.max_keep)
    chosen = np.repeat(chunk_mask, chunk)[:n] | forced
    if lines is not None:
        chosen = widen(chosen, lines, params.whole_lines, params.code_blocks, skeleton=code and params.code_skeleton,
                       named=params.named_lines, max_line_tokens=params.max_line_tokens)
        if code and params.named_lines and params.named_focus:
            chosen = focus(chosen, forced, lines, params.max_line_tokens)
    return np.flatnonzero(chosen)




def bridge_gaps(indices: np.ndarray, max_gap: int) -> np.ndarray:
    """``indices`` with every gap of at most ``max_gap`` tokens between two runs filled.

    A sparse prefill at original positions pays one pass per run, and each pass after
    the first moves a cell, which makes llama.cpp re-rotate its whole K cache (a K-shift
    over every cell of every slot, core.kv.sparse_prefill); prefilling a short gap is
    cheaper than that, and only adds context."""
    if indices.size < 2 or max_gap <= 0:
        return indices
    gaps = np.diff(indices) - 1
    fill = (gaps > 0) & (gaps <= max_gap)
    if not fill.any():
        return indices
    extra = [np.arange(indices[i] + 1, indices[i + 1]) for i in np.flatnonzero(fill)]
    return np.unique(np.concatenate([indices, *extra]))
