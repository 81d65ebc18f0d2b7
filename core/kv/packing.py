"""Cut a session's cells down to the tokens it keeps and pack them at positions 0..K-1.

The cells of dropped tokens go; every later cell moves down by the positions freed before
it, its K rotated to its new position (a K-shift, as llama-server's context shift does), so
no cell sits past the window and the next token follows the last one.  Gaps that sparse
prefills left close too: after packing, relative distances are in kept tokens.

llama.cpp applies a K-shift at the next decode, and a saved state taken before that holds
the new positions with the old rotation, so the shift is forced at once (one decode of the
last kept token past the end, cut again).  Where slots may share cells (a unified pool), a
shift would move the other slot's cells too, so the sequence first takes private copies of
its cells (save and load).  ``in_order``: the scoring model reads an attention column per
cell in cell order, so its sequence is saved and loaded again, which lays the cells out in
position order with no holes (core.speculator).
"""

from __future__ import annotations

import numpy as np

from core.kv.positions import TokenCells
from core.llama.context import Seq
from core.spans import runs, runs_of_equal


def pack(seq: Seq, kv: TokenCells, keep: np.ndarray, in_order: bool = False) -> None:
    """Drop the cells of the tokens ``kv`` holds that ``keep`` (a mask over its logical
    tokens) leaves out, and pack the rest at 0..K-1 in logical order."""
    pos = np.asarray(kv.kv_pos, dtype=np.int64)
    held = pos >= 0
    stay = held & keep[: pos.size]
    if not held.any():
        return
    if not seq.ctx.private_cells:
        _reload(seq)
    for a, b in runs(np.sort(pos[held & ~stay])):
        seq.remove_cells(a, b)
    old = pos[stay]
    shift = np.arange(old.size) - old
    for a, b in runs_of_equal(shift):
        if shift[a]:
            seq.shift_cells(int(old[a]), int(old[b - 1]) + 1, int(shift[a]))
    new = np.full(pos.size, -1, dtype=np.int64)
    new[stay] = np.arange(old.size)
    kv.kv_pos[:] = new.tolist()
    if old.size:
        last = int(np.flatnonzero(stay)[-1])
        seq.decode([kv.tokens[last]], old.size, logits_last=False)  # applies the K-shift now
        seq.remove_from(old.size)
    if in_order:
        _reload(seq)


def _reload(seq: Seq) -> None:
    """Save the sequence's cells and load them back: private copies, laid out in position order."""
    blob = seq.save()
    seq.clear_cells()
    seq.load_state(blob)
