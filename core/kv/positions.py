"""Bookkeeping of what one session holds in each model's KV cache.

The target may hold only some of the session's tokens (sparse prefill), and in
``compact`` mode at positions other than their logical ones, so each logical
token records its KV position, or -1 when it was dropped.

The speculator may *mirror* the target: when scoring a long delta, it can drop
the history the target dropped and re-prefill only the target's cells, so the
delta attends to as few cells in both models (:func:`plan_speculator_sync`).
Its cells then stay in logical order (a cleared sequence fills its cells in
order), which is what maps a captured attention column to a logical token, and
each sits at its logical position.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from core.spans import common_prefix, runs


def dense_prefix(state: TokenCells, tokens: Sequence[int]) -> int:
    """How many leading ``tokens`` ``state`` holds, each cached at its own position (what
    another sequence can copy as is: no dropped token, no compacted position)."""
    n = min(len(state.tokens), len(tokens))
    i = 0
    while i < n and state.tokens[i] == tokens[i] and state.kv_pos[i] == i:
        i += 1
    return i


def speculator_backlog(kv: SessionKV, limit: int) -> tuple[int, list[int]]:
    """What the scorer's sequence lacks of the target's logical tokens, where it can be
    caught up by a plain prefill: (the position to start at, the tokens, up to position
    ``limit``).  Only a scorer that holds a dense prefix of the target's tokens (each at its
    own position: not mirroring a sparse target) is caught up, and not once the target's
    cells were packed (its tokens may outnumber the window); else (0, [])."""
    spec, target = kv.speculator, kv.target
    n = len(spec.tokens)
    if target.packed or n >= len(target.tokens) or dense_prefix(spec, target.tokens) != n:
        return 0, []
    return n, target.tokens[n:max(n, limit)]


@dataclass(slots=True)
class TokenCells:
    """One model's view of a session: logical tokens and where each sits in the KV."""

    tokens: list[int] = field(default_factory=list)
    kv_pos: list[int] = field(default_factory=list)  # -1 = not in the cache (dropped)

    @property
    def next_pos(self) -> int:
        """The KV position right after the last cached token."""
        return self.next_pos_at(len(self.kv_pos))

    @property
    def packed(self) -> int:
        """Positions given up before the last cached token: 0 while each cell sits at its
        logical position, more once cells were packed (compact mode, core.kv.packing)."""
        for i in range(len(self.kv_pos) - 1, -1, -1):
            if self.kv_pos[i] >= 0:
                return i - self.kv_pos[i]
        return 0

    @property
    def end_pos(self) -> int:
        """The position the next logical token takes at its original distance from the last
        cached one (trailing dropped tokens keep their gap)."""
        return len(self.tokens) - self.packed

    @property
    def n_cached(self) -> int:
        return sum(1 for p in self.kv_pos if p >= 0)

    def truncate(self, n_logical: int) -> int:
        """Forget logical tokens from ``n_logical`` on; returns the KV position to cut from."""
        del self.tokens[n_logical:]
        del self.kv_pos[n_logical:]
        return self.next_pos

    def next_pos_at(self, n_logical: int) -> int:
        """The KV position right after the last cached token among the first ``n_logical``."""
        for pos in reversed(self.kv_pos[:n_logical]):
            if pos >= 0:
                return pos + 1
        return 0

    def extend(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        self.kv_pos.extend(positions)

    def extend_kept(self, tokens: Sequence[int], kept: np.ndarray, base: int, compact: bool) -> None:
        """Record ``tokens`` of which only those at indices ``kept`` were prefilled: in order
        from ``base`` (``compact``), or each at ``base`` plus its index."""
        positions = np.full(len(tokens), -1, dtype=np.int64)
        positions[kept] = np.arange(kept.size) + base if compact else kept + base
        self.extend(tokens, positions.tolist())

    def reset(self) -> None:
        self.tokens.clear()
        self.kv_pos.clear()


@dataclass(slots=True)
class SessionKV:
    """Both models' views of one session's context."""

    target: TokenCells = field(default_factory=TokenCells)
    speculator: TokenCells = field(default_factory=TokenCells)
    scores: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.float32))
    # each logical token's importance from the last turn that scored (what eviction drops by)

    def reset(self) -> None:
        self.target.reset()
        self.speculator.reset()
        self.scores = np.zeros(0, dtype=np.float32)

    def scores_over(self, n: int, valid: int) -> np.ndarray:
        """Importance of ``n`` logical tokens, of which the first ``valid`` are the tokens
        last scored; NaN where no turn scored them."""
        out = np.full(n, np.nan, dtype=np.float32)
        m = min(n, valid, self.scores.size)
        out[:m] = self.scores[:m]
        return out


def cached_indices(state: TokenCells, n: int | None = None) -> list[int]:
    """The logical indices (of the first ``n``) that ``state`` holds, in cell order."""
    return [i for i, p in enumerate(state.kv_pos[:n]) if p >= 0]


Cost = Callable[[int, int, int], float]  # (new tokens, cells before them, calls) -> seconds


@dataclass(slots=True, frozen=True)
class SpeculatorSync:
    """How the speculator reaches ``tokens``: keep its common prefix and prefill the rest,
    or (``rebuild``) start empty, re-prefill the target's cells of the shared history
    (logical indices ``rebuild``), then prefill the rest densely from ``start``."""

    start: int  # first logical token prefilled densely
    cells: int  # cells attended before that prefill
    rebuild: tuple[int, ...] | None = None
    rebuild_runs: int = 0  # the contiguous runs ``rebuild`` forms (one prefill call each)
    packed: bool = False  # the rebuilt cells go at 0..K-1, as the target's packed cells are (core.kv.packing)

    @property
    def n_rebuild(self) -> int:
        return len(self.rebuild or ())


def plan_speculator_sync(spec: TokenCells, target: TokenCells, tokens: Sequence[int], cost: Cost,
                         calls: Callable[[int], int],
                         bridge_s: Callable[[int], float] = lambda cells: 0.0,
                         limit: int = 1 << 62) -> SpeculatorSync:
    """Rebuild the speculator as the target's mirror only when the new tokens' cheaper
    attention (fewer cells) repays re-prefilling the target's cells (run by run, a
    bridge costing ``bridge_s(cells)`` between runs), by ``cost``, or when staying would
    take ``limit`` cells or more (a conversation past the window)."""
    keep = common_prefix(spec.tokens, tokens)
    cells = len(cached_indices(spec, keep))
    stay = SpeculatorSync(keep, cells)
    fits = spec.end_pos - (len(spec.tokens) - keep) + len(tokens) - keep < limit
    q = common_prefix(target.tokens, tokens)
    if fits and not any(spec.kv_pos[i] >= 0 > target.kv_pos[i] for i in range(min(keep, q))):
        return stay  # the speculator holds nothing the target dropped
    if q == 0:
        return stay  # no target cells to mirror
    held = cached_indices(target, q)
    if held[-1:] != [q - 1]:
        held.append(q - 1)  # the last history token keeps logical positions contiguous after it
    n_runs = len(runs(np.asarray(held)))
    m_stay, m_new = len(tokens) - keep, len(tokens) - q
    rebuild = (cost(len(held), 0, n_runs) + (n_runs - 1) * bridge_s(len(held) // 2)
               + cost(m_new, len(held), calls(m_new)))
    if fits and rebuild >= cost(m_stay, cells, calls(m_stay)):
        return stay
    return SpeculatorSync(q, len(held), tuple(held), n_runs, target.packed > 0)
