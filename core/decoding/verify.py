"""Verifying drafted tokens with the target, under the reply's grammar: what speculative
decoding (a draft model, core.decoding.speculative) and prompt-lookup decoding (drafts copied
from the context, core.decoding.lookup) share.

The target decodes ``[tok, *drafts]`` in one batch; row i is masked in the grammar state the
drafts before it lead to, the acceptance rule (core.decoding.acceptance) keeps a prefix, and
the matcher is rolled back over the rest.  Greedy replies are the target's argmax at every
step; sampled ones keep the target's distribution (standard speculative sampling)."""

from __future__ import annotations

import numpy as np

from core.decoding.acceptance import accept_greedy, accept_stochastic, distribution, sample
from core.decoding.guided import Guide
from core.llama.context import Seq
from core.policies import SamplingParams


class Verifier:
    def __init__(self, target: Seq, guide: Guide | None = None) -> None:
        self.target, self.guide = target, guide

    def _masked(self, logits: np.ndarray) -> np.ndarray:
        if self.guide is not None:
            self.guide.mask(logits)
        return logits

    def _accepted(self, tok: int) -> None:
        """Walk the matcher over ``tok``; an end-of-generation token ends the reply instead (and
        llguidance does not count one it consumed when rolling back)."""
        if self.guide is not None and not self.target.model.is_eog(tok):
            self.guide.accept(tok)

    def _rollback(self, drafts: list[int]) -> None:
        if self.guide is not None:
            self.guide.rollback(sum(not self.target.model.is_eog(d) for d in drafts))

    @staticmethod
    def _pick(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator) -> int:
        if params.temperature <= 0.0:
            return int(np.argmax(logits))
        return sample(distribution(logits, params), rng)

    def _accept(self, n_rows: int, drafts: list[int], q_rows: list[np.ndarray], params: SamplingParams,
                rng: np.random.Generator) -> tuple[int, int]:
        """Accept a prefix of ``drafts`` from the target's last batch (``n_rows`` rows, row i
        after drafts[:i]); ``q_rows``: the draft's distributions (sampling only).  Returns
        (drafts accepted, the target's next token), the matcher walked over both."""
        rows, walked = [], 0
        for i in range(n_rows):  # row i in the grammar's state after drafts[:i]
            rows.append(self._masked(self.target.logits_at(i)))
            if i == len(drafts) or np.isneginf(rows[i][drafts[i]]):
                break  # a draft the grammar forbids is never accepted: feeding it would break the matcher
            self._accepted(drafts[i])
            walked += 1
        considered = drafts[:walked + 1]  # with the forbidden one: p = 0 rejects it, as the rule would
        if params.temperature <= 0.0:
            k, nxt = accept_greedy(rows, considered)
        else:
            k, nxt = accept_stochastic([distribution(r, params) for r in rows], q_rows, considered, rng)
        self._rollback(drafts[k:walked])
        self._accepted(nxt)
        return k, nxt
