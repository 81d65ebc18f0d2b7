"""The cell edits a turn asks for by what they mean: cut a sequence back to the tokens it
keeps, empty it, or decode a verify batch through a view and keep only what was accepted.
With core.kv.slot_cells (whole slots), core.kv.sparse_prefill (bridged runs) and
core.kv.scoring_window (the windowed scoring prefill), these are the only callers of the
cell-changing calls of core.llama.context (marked ``changes_cells``): each edit that a
session's bookkeeping (core.kv.positions) records is made here, beside it."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from core.kv.positions import TokenCells
from core.llama.context import Context, Seq


def rollback(seq: Seq, kv: TokenCells, n_keep: int) -> None:
    """Keep the first ``n_keep`` tokens ``kv`` records (a common prefix) and cut the cells after them."""
    if n_keep < len(kv.tokens):
        seq.remove_from(kv.truncate(n_keep))


def reset(seq: Seq, kv: TokenCells | None = None) -> None:
    """Empty ``seq`` and the record of what it held."""
    seq.clear_cells()
    if kv is not None:
        kv.reset()


def cut_from(seq: Seq, pos: int) -> None:
    """Drop ``seq``'s cells from ``pos`` on: tokens decoded past what the turn keeps
    (lookahead steps, rejected drafts, a reply cut short), which no record holds."""
    seq.remove_from(pos)


def empty(ctx: Context) -> None:
    """Empty every sequence of ``ctx`` (startup probes and calibration, before any session)."""
    ctx.clear_cells()


@contextmanager
def verify_view(seq: Seq, spans: Sequence[tuple[int, int]]) -> Iterator[View]:
    """A view of ``seq``'s cells at ``spans`` for one verify batch (SpecAttn): the batch
    decoded through it attends to those alone; :meth:`View.keep` adds the accepted new
    cells to ``seq``, and the rest leave with the view."""
    seq.make_view(spans)
    try:
        yield View(seq)
    finally:
        seq.drop_view()  # frees the rejected cells, which only the view held


class View:
    __slots__ = ("seq",)

    def __init__(self, seq: Seq) -> None:
        self.seq = seq

    def keep(self, p0: int, p1: int) -> None:
        """Make the view's new cells at positions [p0, p1) the sequence's own."""
        self.seq.commit_view(p0, p1)
