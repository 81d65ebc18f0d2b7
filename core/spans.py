"""Spans of token indices: contiguous runs of a selection, and the common prefix of two
token lists (pure; shared by selection, the KV bookkeeping and the sessions)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """Contiguous [start, end) runs of sorted indices."""
    if indices.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(indices) != 1) + 1
    starts = np.concatenate(([0], breaks))
    ends = np.concatenate((breaks, [indices.size]))
    return [(int(indices[s]), int(indices[e - 1]) + 1) for s, e in zip(starts, ends, strict=False)]


def runs_of_equal(values: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) runs of equal consecutive ``values``."""
    if values.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(values) != 0) + 1
    edges = np.concatenate(([0], breaks, [values.size]))
    return [(int(a), int(b)) for a, b in zip(edges[:-1], edges[1:], strict=True)]
