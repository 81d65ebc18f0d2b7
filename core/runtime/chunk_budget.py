"""How many prefill tokens a step may carry while other turns stream (pure).

A chunk rides in the same step as every decoding turn's next token, so each of
its tokens adds to every streaming session's inter-token gap.  With ``share``
set, the chunk is sized by measured costs: its expected cost is at most
``share`` times what the step costs without it, so the streams' gaps grow by at
most ``1 + share`` while the pending prefill keeps moving (at least one token a
step: a long prompt is never starved by a stream of short turns).  This is
Sarathi-Serve's stall-free batching with a time budget instead of a fixed token
count.  On a GPU a chunk costs almost nothing beside the decode rows and ``cap``
decides; on a CPU, where prefill is compute-bound, the budget does.

``cap`` 0 is *decode first* (no prefill at all while anyone streams); ``share``
0, or no cost function, is a fixed chunk of ``cap`` tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ALPHA = 0.3  # EWMA weight of the newest step

# seconds to prefill n tokens at position pos of a context in one call, by the engine's measured costs
ChunkCost = Callable[[Any, int, int], float]


@dataclass(slots=True)
class ChunkBudget:
    cap: int  # the most prefill tokens one streaming step carries
    share: float = 0.0  # a chunk may cost this much of the rest of its step; 0 = a fixed chunk of cap
    cost: ChunkCost | None = None
    base_s: float | None = None  # EWMA: what a streaming step costs without its chunk

    def tokens(self, ctx: Any, pos: int) -> int:
        """The chunk for a prefill at ``pos`` in ``ctx`` in the next streaming step."""
        if self.cap == 0 or self.share <= 0 or self.cost is None:
            return self.cap
        if self.base_s is None:
            return 0  # one step without a chunk first: it measures what the streams cost alone
        one = self.cost(ctx, 1, pos)
        per_token = self.cost(ctx, 2, pos) - one
        if per_token <= 0:  # not calibrated
            return self.cap
        fixed = one - per_token  # the chunk's own llama_decode pass (split streams decode it apart)
        return max(1, min(self.cap, int((self.share * self.base_s - fixed) / per_token)))

    def chunk_s(self, ctx: Any, n: int, pos: int) -> float:
        return self.cost(ctx, n, pos) if self.cost is not None and n > 0 else 0.0

    def observe(self, step_s: float, chunk_s: float) -> None:
        """A streaming step took ``step_s``, of which its chunk was expected to take ``chunk_s``."""
        base = max(0.0, step_s - chunk_s)
        self.base_s = base if self.base_s is None else self.base_s + ALPHA * (base - self.base_s)
