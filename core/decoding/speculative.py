"""Speculative decoding with the speculator as the draft, and SpecAttn's sparse verify.

One round: the draft decodes gamma tokens one by one (capturing its attention
rows when SpecAttn is on), the target verifies the input token and all drafts
in one batch, the acceptance rule (core.decoding.acceptance) keeps a prefix, and
both caches are cut back to what was accepted.  With SpecAttn the target's
batch attends only through a view (core.llama.Context.make_view) of
the cells the draft's attention selected, and only the accepted new cells are
committed to the target's sequence; the full cache is never touched.

Bookkeeping: ``positions[i]`` is the target KV position of logical token i (-1
when a sparse prefill dropped it); the draft holds logical token i at position
i, all of them or (mirroring the target, core.kv.positions) the prompt tokens
``held`` and everything after; ``pending`` are tokens the draft has not decoded
yet.  Draft attention columns are its cells, in logical order.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from core.decoding.acceptance import distribution, sample
from core.decoding.decode import Generation, OnText, TextStream
from core.decoding.guided import Guide
from core.decoding.specattn import SparseVerify, view_spans
from core.decoding.verify import Verifier
from core.kv import cells
from core.llama.capture import AttentionCapture
from core.llama.context import Seq
from core.policies import SamplingParams
from core.results import SpeculativeStats
from core.steps import TurnSteps

DraftReady = Callable[[], tuple[list[int], int, list[int]]]  # pending, their position, prompt tokens held


@dataclass(slots=True)
class SpeculativeGeneration:
    gen: Generation
    stats: SpeculativeStats
    draft_pos: int = 0
    draft_committed: list[int] = field(default_factory=list)  # tokens the draft now holds from draft_pos on


@dataclass(slots=True)
class _Round:
    drafts: list[int]
    q_rows: list[np.ndarray]
    steps: list[np.ndarray]


class SpeculativeDecoder(Verifier):
    """Draft with ``draft``, verify with ``target``; one reply at a time."""

    def __init__(self, target: Seq, draft: Seq, capture: AttentionCapture | None,
                 gamma: int, sparse: SparseVerify | None = None, guide: Guide | None = None) -> None:
        """``guide``: the reply's constraint.  The draft samples under its mask, each verified
        row is masked in the state its drafts lead to, and the matcher is rolled back over
        the rejected ones, so the reply is what plain constrained decoding gives."""
        super().__init__(target, guide)
        self.draft, self.capture, self.gamma, self.sparse = draft, capture, gamma, sparse

    def generate(self, positions: list[int], draft_ready: DraftReady, params: SamplingParams,
                 on_text: OnText | None = None, idx: int = -1) -> TurnSteps[SpeculativeGeneration]:
        """Continue from the target logits in place (the prompt's last token is decoded).
        ``draft_ready`` brings the draft up to the prompt once the first token is out and
        returns (the prompt tail it has not decoded, the position that tail goes to, the
        logical indices of the prompt tokens before it that the draft holds).
        ``idx``: the batch index of the prompt's last logits."""
        stream = TextStream(self.target.model, params, on_text)
        stats, rng = SpeculativeStats(), np.random.default_rng(params.seed)
        positions = list(positions)
        start_pos = tpos = max(positions) + 1
        t0 = time.perf_counter()
        tok = self._pick(self._masked(self.target.logits_at(idx)), params, rng)
        self._accepted(tok)
        first_s = time.perf_counter() - t0
        n_in_target = 0
        go = stream.push(tok)
        t_sync = time.perf_counter()
        pending, draft_pos, held = draft_ready()
        held_pos = [positions[i] for i in held]  # target positions of the draft's first cells
        gap = draft_pos - len(held)  # prompt positions the draft holds no cell for
        t0 += time.perf_counter() - t_sync  # decode time excludes the draft's catch-up (reported apart)
        dpos, pending0 = draft_pos, list(pending)
        while go:
            yield None  # a round is one step of the loop: other turns run between rounds
            room = min(self.target.n_ctx - tpos, self.draft.n_ctx - dpos - len(pending)) - 1
            if room < 0:
                break
            pending.append(tok)
            rnd = self._draft(pending, dpos, gap, min(self.gamma, room), params, rng, stats)
            gamma = len(rnd.drafts)  # fewer when a draft ended the reply
            columns = held_pos + positions[draft_pos:] if gap else positions
            k, nxt = self._verify(tok, rnd, positions, columns, tpos, params, rng, stats)
            cells.cut_from(self.target, tpos + 1 + k)  # keep tok and the accepted drafts
            positions.extend(range(tpos, tpos + 1 + k))
            tpos += 1 + k
            n_in_target += 1 + k
            if gamma:  # the draft holds pending + drafts[:gamma-1]; keep what was accepted
                kept = len(pending) + min(k, gamma - 1)
                cells.cut_from(self.draft, dpos + kept)
                dpos, pending = dpos + kept, rnd.drafts[min(k, gamma - 1): k]
            else:
                pending += rnd.drafts[:k]
            go = all(stream.push(d) for d in rnd.drafts[:k]) and stream.push(nxt)
            tok = nxt
        text = stream.close()
        n_decoded = min(n_in_target, len(stream.tokens))
        cells.cut_from(self.target, start_pos + n_decoded)
        committed = (pending0 + stream.tokens)[: min(dpos - draft_pos, len(pending0) + n_decoded)]
        cells.cut_from(self.draft, draft_pos + len(committed))
        gen = Generation(text, stream.tokens, stream.finish, first_s, time.perf_counter() - t0, n_decoded,
                         stream.stop_sequence)
        return SpeculativeGeneration(gen, stats, draft_pos, committed)

    def _draft(self, pending: list[int], dpos: int, gap: int, gamma: int, params: SamplingParams,
               rng: np.random.Generator, stats: SpeculativeStats) -> _Round:
        """Draft ``gamma`` tokens from position ``dpos``; the draft holds ``gap`` fewer
        cells than positions before it."""
        t0 = time.perf_counter()
        rnd = _Round([], [], [])
        capture = self.capture if self.sparse is not None else None
        toks, pos = pending, dpos
        for _ in range(gamma):
            if capture is not None:
                capture.start(pos - gap + len(toks))
            self.draft.decode(toks, pos)
            if capture is not None:
                rnd.steps.append(capture.stop())
            pos += len(toks)
            logits = self._masked(self.draft.logits())
            if params.temperature <= 0.0:
                rnd.drafts.append(int(np.argmax(logits)))
            else:
                q = distribution(logits, params)
                rnd.q_rows.append(q)
                rnd.drafts.append(sample(q, rng))
            self._accepted(rnd.drafts[-1])
            if self.draft.model.is_eog(rnd.drafts[-1]):
                break  # the reply ends there: nothing after it is worth drafting
            toks = [rnd.drafts[-1]]
        self._rollback(rnd.drafts)  # verify walks the matcher through them again
        stats.draft_s += time.perf_counter() - t0
        return rnd

    def _verify(self, tok: int, rnd: _Round, positions: list[int], columns: list[int], tpos: int,
                params: SamplingParams, rng: np.random.Generator, stats: SpeculativeStats) -> tuple[int, int]:
        """Decode [tok, *drafts] in one batch (through the view with SpecAttn) and accept
        a prefix; only accepted cells stay in the target's sequence.  ``columns[c]`` is
        the target position of the token in the draft's cell c."""
        t0 = time.perf_counter()
        batch = [tok, *rnd.drafts]
        n_cells = sum(1 for p in positions if p >= 0)
        n_view = n_cells
        if self.sparse is not None and rnd.steps:
            spans, n_view = view_spans(self.sparse, rnd.steps, columns, tpos)
            with cells.verify_view(self.target, spans) as view:
                self.target.decode(batch, tpos, logits_all=True, through_view=True)
                k, nxt = self._accept(len(batch), rnd.drafts, rnd.q_rows, params, rng)
                view.keep(tpos, tpos + 1 + k)
        else:
            self.target.decode(batch, tpos, logits_all=True)
            k, nxt = self._accept(len(batch), rnd.drafts, rnd.q_rows, params, rng)
        stats.n_rounds += 1
        stats.n_drafted += len(rnd.drafts)
        stats.n_accepted += k
        stats.cells_attended += n_view
        stats.cells_total += n_cells
        stats.verify_s += time.perf_counter() - t0
        return k, nxt
