"""Prompt-lookup decoding: drafts copied from the context, verified by the target in one batch.

A coding agent's reply copies much of its context: an ``Edit``'s ``old_string`` from a file it
read, a ``Write`` of a file that is mostly the old one, the same tool-call scaffolding every
turn. The longest suffix of the tokens so far (an n-gram of ``max_ngram`` down to ``min_ngram``)
is looked up in the prompt and the reply, and the tokens that followed the earlier occurrence
matching furthest back (the latest among equals) are the draft (llama.cpp's n-gram modes, vLLM's
``ngram`` method, "Prompt Lookup Decoding", A. Saxena 2023). Drafts cost nothing; with no match
there is no draft, and the step is a plain one-token decode, batched with the other turns. ``k``
doubles after a fully accepted draft and falls to what was accepted after a miss.

Verification is speculative decoding's (core.decoding.verify): greedy replies are the target's
argmax at every step, sampled ones keep its distribution (the draft is deterministic: q is one
token's mass), constrained ones are masked row by row under the grammar.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from core.decoding.decode import Generation, OnText, TextStream
from core.decoding.drafts import Drafter, Lookup
from core.decoding.guided import Guide
from core.decoding.verify import Verifier
from core.kv import cells
from core.llama.context import Seq
from core.policies import SamplingParams
from core.results import SpeculativeStats
from core.steps import Tokens, TurnSteps


class LookupDecoder(Verifier):
    def __init__(self, target: Seq, guide: Guide | None = None, max_ngram: int = 4, min_ngram: int = 2) -> None:
        super().__init__(target, guide)
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def generate(self, context: Sequence[int], n_past: int, params: SamplingParams, on_text: OnText | None = None,
                 idx: int = -1) -> TurnSteps[tuple[Generation, SpeculativeStats]]:
        """Continue from the target logits in place (batch index ``idx``; the prompt's last
        position is ``n_past - 1``); ``context``: the session's logical tokens, the prompt."""
        stream = TextStream(self.target.model, params, on_text)
        stats, rng, state = SpeculativeStats(), np.random.default_rng(params.seed), Lookup()
        drafter = Drafter(context, self.max_ngram, self.min_ngram)
        t0 = time.perf_counter()
        tok = self._pick(self._masked(self.target.ctx.logits_view(idx)), params, rng)
        self._accepted(tok)
        first_s = time.perf_counter() - t0
        pos, n_decoded = n_past, 0
        go = stream.push(tok)
        while go:
            drafter.extend([tok])
            room = self.target.n_ctx - pos - 1
            if room < 0:
                break
            drafts = drafter.propose(min(state.k, room, params.max_tokens - len(stream.tokens))) \
                if state.ready() else []
            if not drafts:  # a plain step, batched with the other turns
                reply = yield Tokens(self.target, [tok], pos)
                pos, n_decoded = pos + 1, n_decoded + 1
                tok = self._pick(self._masked(self.target.ctx.logits_view(-1 if reply is None else reply)),
                                 params, rng)
                self._accepted(tok)
                go = stream.push(tok)
                continue
            yield None  # a verify runs unbatched: other turns get a step first
            k, nxt = self._verify(tok, drafts, pos, params, rng, stats)
            state.adapt(len(drafts), k)
            drafter.extend(drafts[:k])
            pos, n_decoded = pos + 1 + k, n_decoded + 1 + k
            go = all(stream.push(d) for d in drafts[:k]) and stream.push(nxt)
            tok = nxt
        text = stream.close()
        n_decoded = min(n_decoded, len(stream.tokens))
        cells.cut_from(self.target, n_past + n_decoded)
        gen = Generation(text, stream.tokens, stream.finish, first_s, time.perf_counter() - t0, n_decoded,
                         stream.stop_sequence)
        return gen, stats

    def _verify(self, tok: int, drafts: list[int], pos: int, params: SamplingParams, rng: np.random.Generator,
                stats: SpeculativeStats) -> tuple[int, int]:
        t0 = time.perf_counter()
        self.target.decode([tok, *drafts], pos, logits_all=True)
        q_rows = [] if params.temperature <= 0.0 else [_point(d, self.target.model.n_vocab) for d in drafts]
        k, nxt = self._accept(1 + len(drafts), drafts, q_rows, params, rng)
        cells.cut_from(self.target, pos + 1 + k)  # keep tok and the accepted drafts
        stats.n_rounds += 1
        stats.n_drafted += len(drafts)
        stats.n_accepted += k
        stats.verify_s += time.perf_counter() - t0
        return k, nxt


def _point(tok: int, n_vocab: int) -> np.ndarray:
    """A deterministic draft's distribution: all its mass on ``tok``."""
    q = np.zeros(n_vocab)
    q[tok] = 1.0
    return q
