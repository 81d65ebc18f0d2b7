"""Dense and sparse prefill of the target's KV cache.

llama.cpp rejects a batch whose positions have gaps or that does not start at
the cache's last position + 1, so a sparse prefill at original positions
cannot be one batch.  Two mechanisms work (verified in the project's design
notes, README "How SpecPrefill is done here"):

* ``original`` ("bridge"): decode each contiguous kept run as its own batch;
  before run r, move the previous run's last cell forward so it sits right
  before run r, decode, then move it back (by its position label, exactly, or by a
  K-shift: :func:`sparse_prefill`).  Kept tokens keep their original
  RoPE positions, so decoding continues at the prompt's true length.
* ``compact``: decode the kept tokens at consecutive positions and continue
  from there.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from core.errors import EngineError
from core.llama.context import Seq
from core.spans import runs
from core.specprefill.cost_model import PrefillCost
from core.steps import Tokens, TurnSteps


@dataclass(slots=True)
class Moves:
    """The label moves a sparse prefill made, timed: what its bridges cost at this depth
    (start-up times one move at 130 cells, whose saved state fits in the CPU's caches)."""

    count: int = 0
    seconds: float = 0.0

    def move(self, seq: Seq, moves: Mapping[int, int]) -> None:
        t0 = time.perf_counter()
        seq.move_labels(moves)
        self.seconds += time.perf_counter() - t0
        self.count += 1


def measured_prefill(seq: Seq, tokens: Sequence[int], kept: np.ndarray, mode: str, base_pos: int,
                     cost: PrefillCost, cached: int, calls: int) -> TurnSteps[tuple[int, int, Moves, float]]:
    """:func:`sparse_prefill` after ``cached`` cells, bridged the way ``cost`` says is cheaper,
    in ``calls`` llama_decode calls, and the cost told what it took: the moves as timed,
    the runs' passes less the bridges.  Returns the next position, the logits' batch index,
    the moves and the seconds in all."""
    relabel = seq.ctx.movable_labels and cost.relabels(cached + kept.size // 2)
    moves, t0 = Moves(), time.perf_counter()
    n_past, idx = yield from sparse_prefill(seq, tokens, kept, mode, base_pos, relabel, moves)
    seconds = time.perf_counter() - t0
    cost.observe_moves(moves.count, cached + kept.size // 2, moves.seconds)
    shifts = 0 if mode == "compact" or relabel else len(runs(kept)) - 1  # K-shifts run inside the next decode
    cost.observe(int(kept.size), cached, calls, seconds - moves.seconds - shifts * cost.shift_s)
    return n_past, idx, moves, seconds


def sparse_prefill(seq: Seq, tokens: Sequence[int], kept: np.ndarray, mode: str,
                   base_pos: int, relabel: bool = False,
                   moves: Moves | None = None) -> TurnSteps[tuple[int, int]]:
    """Prefill ``tokens[kept]``; ``base_pos`` is the position of ``tokens[0]`` and
    the sequence must end at ``base_pos - 1`` (or be empty).  Each run is one request
    (core.steps), the last one keeping its logits.  Returns the next position and the
    batch index of those logits.

    A bridge moves a cell by a K-shift, or with ``relabel`` by its position label alone
    (:meth:`Seq.move`): exact, and cheaper while the sequence is short.  Relabelled cells go
    back to their own positions in one move at the end, and each move is timed into
    ``moves``.  A turn cancelled between runs still leaves every cell at its own position."""
    if mode == "compact":
        reply = yield Tokens(seq, [tokens[i] for i in kept], base_pos)
        return base_pos + len(kept), -1 if reply is None else reply
    spans, moves = runs(kept), moves if moves is not None else Moves()
    last = seq.pos_max()  # -1 when the sequence is empty: the first run may start anywhere
    idx: int | None = -1
    relabelled: dict[int, int] = {}  # a bridge cell's borrowed position -> its own
    shifted: tuple[int, int] | None = None  # a K-shifted bridge cell: (borrowed position, gap)
    try:
        for r, (start, end) in enumerate(spans):
            p0 = base_pos + start
            gap = p0 - 1 - last if last >= 0 else 0
            if gap and relabel:
                moves.move(seq, {last: p0 - 1})
                relabelled[p0 - 1] = last
            elif gap:
                seq.shift_cells(last, last + 1, gap)
                shifted = (p0 - 1, gap)
            idx = yield Tokens(seq, tokens[start:end], p0, logits=r == len(spans) - 1)
            if shifted:
                seq.shift_cells(shifted[0], shifted[0] + 1, -shifted[1])
                shifted = None
            last = base_pos + end - 1
    finally:
        if shifted:
            seq.shift_cells(shifted[0], shifted[0] + 1, -shifted[1])
        if relabelled:
            moves.move(seq, relabelled)
    return last + 1, -1 if idx is None else idx


def shift_one(seq: Seq, pos: int) -> None:
    """K-shift the cell at ``pos`` one position on, as a bridge does (start-up times the step
    after it: core.startup.calibrate)."""
    seq.shift_cells(pos, pos + 1, 1)


def move_cost(seq: Seq, cells: int) -> tuple[float, float]:
    """Seconds of moving the last cell's position label and back (:meth:`Seq.move_labels`) in
    ``seq``, which holds ``cells`` cells: (per move, per cell).  Through the saved state
    a move copies the whole sequence (per cell); through a scratch sequence, the moved
    cell alone (per move).  (0, inf) where the context cannot, or where the move did not
    land (an unknown state layout)."""
    last = seq.pos_max()
    if not seq.ctx.movable_labels or last < 0:
        return 0.0, math.inf
    best = float("inf")
    try:
        for there, back in ((last, last + 1), (last + 1, last)):
            t0 = time.perf_counter()
            seq.move_labels({there: back})
            best = min(best, time.perf_counter() - t0)
            if seq.pos_max() != back:
                return 0.0, math.inf
    except EngineError:
        return 0.0, math.inf
    return (0.0, best / cells) if seq.ctx.private_cells else (best, 0.0)
