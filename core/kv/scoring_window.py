"""A windowed scoring prefill: the speculator prefills a long prompt with each token
attending to the first ``SINKS`` cells and the last ``window`` cells only, so the
prefill costs about the same per token at 8K as at 2K.

SpecPrefill scores from the attention of the last prompt token and the lookahead
steps onto every key; those rows still see all cells (core.speculator decodes them in
the slot's own sequence afterwards).  What the window changes is the keys themselves:
above the first layer, a key is computed from hidden states that saw only the window,
as in a streaming (attention-sink) model.  Whether scores keep their quality is an
eval question (results/scorers.md), so the window is a setting.

llama.cpp has no per-batch attention window for this architecture; a *view* does it.
The prefill runs in a one-slot unified context of the scoring model whose view
sequence is re-tagged before each chunk to the sinks and the window; a chunk decoded
through the view attends to the view alone, and its new cells are then added to the
full sequence.

Only the sinks and the window come into that context, and new cells the window has
passed leave it: a masked cell still costs each query row a look at its mask (CPU flash
attention scans every cell the context uses), so a scratch holding the slot's whole
context made a 2.4K-token delta at 15K cost 12.8 s against 8.2 s with the window alone
(0.5B Q4_0, 2 cores).  The slot's cells come out as one saved state, and the new cells
go back joined to it, through buffers kept between prefills (fresh pages cost more than
the copy on this kind of VM).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.llama import seq_cells
from core.llama.context import Context, Seq
from core.steps import Tokens, TurnSteps

SINKS = 64  # the first cells every token keeps attending to (attention sinks)


def view_spans(base: int, window: int, sinks: int = SINKS) -> list[tuple[int, int]]:
    """Positions [p0, p1) a chunk starting at ``base`` attends to, besides itself."""
    if base - window <= sinks:
        return [(0, base)] if base else []
    return [(0, sinks), (base - window, base)]


class ScoringWindow:
    """The scratch context and the windowed prefill of one slot at a time."""

    def __init__(self, ctx: Context, window: int) -> None:
        self.ctx, self.window = ctx, window
        self.busy = False
        # saved states: the slot's, the scratch's, the slot's with the new cells joined
        self._slot, self._scratch, self._merged = bytearray(), bytearray(), bytearray()

    @property
    def span(self) -> int:
        """The most cells a windowed prefill token attends to (a chunk may add one batch)."""
        return SINKS + self.window + self.ctx.n_batch

    def applies(self, base: int, n: int) -> bool:
        """Whether a prefill of ``n`` tokens after ``base`` cells goes through the window: it
        would attend less, it is long enough to repay copying the slot's cells twice (a
        short delta after a long context is not: it stays exact), and the scratch context
        is free."""
        return not self.busy and n >= self.window and base + n > self.span

    def reserve(self, seq: Seq) -> bool:
        """Grow the kept saved states ahead of a windowed prefill of ``seq`` (idle time)."""
        size = seq.state_size()
        return seq_cells.reserve(self._slot, size) | seq_cells.reserve(self._merged, size)

    def close(self) -> None:
        self.ctx.close()

    def prefill(self, seq: Seq, tokens: Sequence[int], base: int) -> TurnSteps[None]:
        """Bring ``seq`` (holding cells up to ``base``) to ``tokens`` more at base.., each
        attending through the window; chunk by chunk through the step loop.  ``seq`` is
        written once, at the end: a cancelled prefill leaves it as it was."""
        self.busy = True
        full = self.ctx.seq(0)
        view = full.view()
        mine = seq_cells.parse(seq.save_to(self._slot), seq.id) if seq.pos_max() >= 0 else None
        floor = max(base, SINKS)  # new cells below it are sinks: they stay
        passed = floor  # new cells in [floor, passed) are out of the scratch, in ``done``
        low = max(SINKS, base - self.window)  # the scratch holds the sinks and positions low..
        done: list[seq_cells.Cells] = []
        try:
            if mine is not None:
                near = mine.take(np.flatnonzero((mine.positions < SINKS) | (mine.positions >= base - self.window)))
                full.load_buffer(seq_cells.write_into(near.of(full.id, 1, 0), self._scratch))
            for off in range(0, len(tokens), self.ctx.n_batch):
                start = base + off
                if start - self.window - low >= self.ctx.n_batch:  # a batch's worth the window passed
                    cut = start - self.window
                    if cut > passed:
                        done.append(self._cells(full).at(passed, cut).owned())
                        passed = cut
                    full.remove_cells(low, cut)
                    low = cut
                part = tokens[off: off + self.ctx.n_batch]
                full.make_view(view_spans(start, self.window))
                yield Tokens(view, part, start, logits=False)
                full.commit_view(start, start + len(part))
            full.drop_view()
            left = self._cells(full)
            # in position order: the scorer reads a captured row's columns as the cells in order
            parts = [mine] if mine is not None else []
            parts += [left.at(base, floor), *done, left.at(passed, base + len(tokens))]
            seq.load_buffer(seq_cells.write_joined_into(
                [c.of(seq.id, seq.ctx.n_stream, seq.stream) for c in parts if len(c)], self._merged))
        finally:
            self.ctx.clear_cells()
            self.busy = False

    def _cells(self, full: Seq) -> seq_cells.Cells:
        return seq_cells.parse(full.save_to(self._scratch), full.id)
