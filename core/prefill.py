"""Dense and sparse prefill of the target's KV cache.

llama.cpp rejects a batch whose positions have gaps or that does not start at
the cache's last position + 1, so a sparse prefill at original positions
cannot be one batch.  Two mechanisms work (verified in the project's design
notes, README "How SpecPrefill is done here"):

* ``original`` ("bridge"): decode each contiguous kept run as its own batch;
  before run r, move the previous run's last cell forward so it sits right
  before run r, decode, then move it back.  Kept tokens keep their original
  RoPE positions, so decoding continues at the prompt's true length.
* ``compact``: decode the kept tokens at consecutive positions and continue
  from there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.llama_bindings import Context
from core.selection import runs


def dense_prefill(ctx: Context, tokens: Sequence[int], base_pos: int) -> int:
    """Returns the position of the next token."""
    ctx.decode(tokens, base_pos)
    return base_pos + len(tokens)


def sparse_prefill(ctx: Context, tokens: Sequence[int], kept: np.ndarray, mode: str,
                   base_pos: int) -> int:
    """Prefill ``tokens[kept]``; ``base_pos`` is the position of ``tokens[0]`` and
    the cache must end at ``base_pos - 1`` (or be empty).  Returns the next position."""
    if mode == "compact":
        return dense_prefill(ctx, [tokens[i] for i in kept], base_pos)
    spans = runs(kept)
    last = ctx.pos_max()  # -1 when the cache is empty: the first run may start anywhere
    for r, (start, end) in enumerate(spans):
        p0 = base_pos + start
        gap = p0 - 1 - last if last >= 0 else 0
        if gap:
            ctx.shift(last, last + 1, gap)
        ctx.decode(tokens[start:end], p0, logits_last=r == len(spans) - 1)
        if gap:
            ctx.shift(p0 - 1, p0, -gap)
        last = base_pos + end - 1
    return last + 1
