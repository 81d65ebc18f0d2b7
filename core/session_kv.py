"""Bookkeeping of what one session holds in each model's KV cache.

The target may hold only some of the session's tokens (sparse prefill), and in
``compact`` mode at positions other than their logical ones, so each logical
token records its KV position, or -1 when it was dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def dense_prefix(state: SeqState, tokens: Sequence[int]) -> int:
    """How many leading ``tokens`` ``state`` holds, each cached at its own position (what
    another sequence can copy as is: no dropped token, no compacted position)."""
    n = min(len(state.tokens), len(tokens))
    i = 0
    while i < n and state.tokens[i] == tokens[i] and state.kv_pos[i] == i:
        i += 1
    return i


@dataclass(slots=True)
class SeqState:
    """One model's view of a session: logical tokens and where each sits in the KV."""

    tokens: list[int] = field(default_factory=list)
    kv_pos: list[int] = field(default_factory=list)  # -1 = not in the cache (dropped)

    @property
    def next_pos(self) -> int:
        """The KV position right after the last cached token."""
        for pos in reversed(self.kv_pos):
            if pos >= 0:
                return pos + 1
        return 0

    @property
    def n_cached(self) -> int:
        return sum(1 for p in self.kv_pos if p >= 0)

    def truncate(self, n_logical: int) -> int:
        """Forget logical tokens from ``n_logical`` on; returns the KV position to cut from."""
        del self.tokens[n_logical:]
        del self.kv_pos[n_logical:]
        return self.next_pos

    def extend(self, tokens: Sequence[int], positions: Sequence[int]) -> None:
        self.tokens.extend(tokens)
        self.kv_pos.extend(positions)

    def reset(self) -> None:
        self.tokens.clear()
        self.kv_pos.clear()


@dataclass(slots=True)
class SessionKV:
    """Both models' views of one session's context."""

    target: SeqState = field(default_factory=SeqState)
    speculator: SeqState = field(default_factory=SeqState)

    def reset(self) -> None:
        self.target.reset()
        self.speculator.reset()
