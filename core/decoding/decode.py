"""Decoding: sampling (a grammar's mask, then the sampler chain), stop strings, and the
per-token loop."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.decoding.guided import Guide
from core.decoding.stop import StopMatcher
from core.llama.context import Context, Seq
from core.llama.model import Model
from core.llama.sampler import SamplerChain
from core.policies import SamplingParams
from core.steps import Tokens, TurnSteps

# Called with each new piece of text; return False to stop generating (client gone, cancel).
OnText = Callable[[str], bool]


class Sampler:
    """The sampler chain, behind the grammar's mask when the reply is constrained."""

    def __init__(self, params: SamplingParams, model: Model | None = None) -> None:
        # a constrained reply masks the logits first (core.decoding.guided); only plain decoding does
        self.guide = Guide(model, params.constraint) if params.constraint is not None and model else None
        self.chain = SamplerChain(params)

    def sample(self, ctx: Context, idx: int = -1) -> int:
        """From the logits of batch index ``idx`` of the context's last batch."""
        if self.guide is not None:
            self.guide.mask(ctx.logits_view(idx))
        tok = self.chain.sample(ctx, idx)
        if self.guide is not None:
            self.guide.accept(tok)
        return tok

    def close(self) -> None:
        self.chain.close()


@dataclass(slots=True)
class Generation:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    first_token_s: float  # seconds from decode start to the first sampled token
    decode_s: float
    n_decoded: int  # leading tokens of ``tokens`` that were decoded into the KV cache
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
    grammar_ms: float = 0.0  # compiling the reply's constraint
    mask_ms: float = 0.0  # masking logits under it, over the whole reply


class TextStream:
    """Sampled tokens -> text: EOG, stop strings, ``max_tokens`` and the caller's callback.

    Shared by plain and speculative decoding, so both end a reply the same way."""

    def __init__(self, model: Model, params: SamplingParams, on_text: OnText | None) -> None:
        self.model = model
        self.max_tokens = params.max_tokens
        self.on_text = on_text
        self.tokens: list[int] = []
        self.finish = "length"
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = StopMatcher(params.stop)
        self._pieces: list[str] = []

    def push(self, tok: int) -> bool:
        """Take one sampled token; False when the reply is over."""
        if self.model.is_eog(tok):
            self.finish = "stop"
            return False
        self.tokens.append(tok)
        emit = self._stops.feed(self._utf8.decode(self.model.token_bytes(tok)))
        if emit:
            self._pieces.append(emit)
            if self.on_text is not None and not self.on_text(emit):
                self.finish = "cancelled"
                return False
        if self._stops.stopped:
            self.finish = "stop"
            return False
        return len(self.tokens) < self.max_tokens

    @property
    def stop_sequence(self) -> str | None:
        return self._stops.matched

    def close(self) -> str:
        """Flush held-back text (unless cancelled or stopped); returns the whole reply."""
        if self.finish != "cancelled" and not self._stops.stopped:
            tail = self._stops.flush() + self._utf8.decode(b"", final=True)
            if tail:
                self._pieces.append(tail)
                if self.on_text is not None:
                    self.on_text(tail)
        return "".join(self._pieces)


def generate(seq: Seq, n_past: int, params: SamplingParams, on_text: OnText | None = None,
             idx: int = -1) -> TurnSteps[Generation]:
    """Sample from the logits already in the context (batch index ``idx``; the prompt's
    last position is ``n_past - 1``) until EOG, a stop string, ``max_tokens`` or the
    callback says stop.  Each new token is a one-token request (see core.steps)."""
    sampler = Sampler(params, seq.model)
    stream = TextStream(seq.model, params, on_text)
    t0 = time.perf_counter()
    first_s = 0.0
    n_decoded = 0
    try:
        while True:
            tok = sampler.sample(seq.ctx, idx)
            first_s = first_s or time.perf_counter() - t0
            if not stream.push(tok) or n_past + len(stream.tokens) >= seq.n_ctx:
                break
            reply = yield Tokens(seq, [tok], n_past + len(stream.tokens) - 1)
            idx = -1 if reply is None else reply
            n_decoded += 1
    finally:
        sampler.close()
    text = stream.close()
    guide = sampler.guide
    grammar_ms, mask_ms = (guide.compile_s * 1e3, guide.mask_s * 1e3) if guide else (0.0, 0.0)
    return Generation(text, stream.tokens, stream.finish, first_s, time.perf_counter() - t0, n_decoded,
                      stream.stop_sequence, grammar_ms, mask_ms)
