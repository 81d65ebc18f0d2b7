"""Earlier turns' dropped tokens prefilled back into the target, each at its own position.

A sparse prefill keeps what the scorer and the request of its turn pointed at; a later
request may name code it dropped ("now copy ``other_function``").  Those tokens (chosen by
core.specprefill.lines.recall) go back before the turn's own prefill.  llama.cpp appends a
batch only right after a sequence's last cell, so the cells from the first recalled position
on are taken out (saved), the recalled runs are prefilled as a sparse prefill's runs are
(core.kv.sparse_prefill: each attends to the cells before it), and the cells taken out are
joined back, in position order, in one load.  A recalled run attends to what the sequence
held before its first token, and to the recalled runs before it: the cells kept between two
runs are out while the runs are prefilled, as later cells are during any prefill.  So a named
block comes back as one run, its kept lines prefilled again among the dropped ones
(core.specprefill.lines.recall), and cells kept inside a run are replaced by the new ones.

The saved states go through buffers kept between recalls (fresh pages cost more than the copy
on this kind of VM); one slot recalls at a time, and a turn that finds the buffers busy does
without.
"""

from __future__ import annotations

import numpy as np

from core.kv.positions import TokenCells
from core.kv.sparse_prefill import sparse_prefill
from core.llama import seq_cells
from core.llama.context import Seq
from core.spans import runs
from core.steps import TurnSteps


class Recall:
    def __init__(self) -> None:
        self.busy = False
        self._saved, self._now, self._joined = bytearray(), bytearray(), bytearray()

    def run(self, seq: Seq, kv: TokenCells, indices: np.ndarray, relabel: bool = False) -> TurnSteps[None]:
        """Prefill ``kv.tokens[indices]`` (ascending logical indices, some the sequence dropped, in
        a session whose cells sit at their logical positions) into ``seq`` at their positions,
        and record them in ``kv``.  A turn cancelled meanwhile leaves the cells taken out
        out, and ``kv`` as it was: the caller's failure path rebuilds the session."""
        self.busy = True
        try:
            first, end = int(indices[0]), int(indices[-1]) + 1
            saved = seq_cells.parse(seq.save_to(self._saved), seq.id)
            seq.remove_cells(first, -1)
            yield from sparse_prefill(seq, kv.tokens[first:end], indices - first, "original", first, relabel)
            now = seq_cells.parse(seq.save_to(self._now), seq.id)
            seq.load_buffer(seq_cells.write_joined_into(_in_order(now, saved, first, indices), self._joined))
            for i in indices.tolist():
                kv.kv_pos[i] = i
        finally:
            self.busy = False


def _in_order(now: seq_cells.Cells, saved: seq_cells.Cells, first: int,
              indices: np.ndarray) -> list[seq_cells.Cells]:
    """The cells before ``first`` and the recalled runs (``now``), with the saved cells from
    ``first`` on between and after them, in position order."""
    parts, at = [now.at(0, first)], first
    for a, b in runs(indices):
        parts += [saved.at(at, a), now.at(a, b)]
        at = b
    parts.append(saved.at(at, 1 << 62))
    return [p for p in parts if len(p)]
