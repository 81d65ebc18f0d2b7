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
full sequence.  The slot's existing cells come in, and the result goes back, as saved
states (two copies of the slot's cells: ~0.1 s at 8K for the 0.5B model).
"""

from __future__ import annotations

from collections.abc import Sequence

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

    def close(self) -> None:
        self.ctx.close()

    def prefill(self, seq: Seq, tokens: Sequence[int], base: int) -> TurnSteps[None]:
        """Bring ``seq`` (holding cells up to ``base``) to ``tokens`` more at base.., each
        attending through the window; chunk by chunk through the step loop."""
        self.busy = True
        full = self.ctx.seq(0)
        view = full.view()
        try:
            full.load_from(seq)
            for off in range(0, len(tokens), self.ctx.n_batch):
                start = base + off
                part = tokens[off: off + self.ctx.n_batch]
                full.make_view(view_spans(start, self.window))
                yield Tokens(view, part, start, logits=False)
                full.commit_view(start, start + len(part))
            full.drop_view()
            seq.load_from(full)
        finally:
            self.ctx.clear()
            self.busy = False
