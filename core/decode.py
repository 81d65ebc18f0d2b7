"""Decoding: llama.cpp's sampler chain, stop strings, and the per-token loop."""

from __future__ import annotations

import codecs
import time
from collections.abc import Callable
from dataclasses import dataclass

import llama_cpp

from core.config import SamplingParams
from core.llama_bindings import Context

# Called with each new piece of text; return False to stop generating (client gone, cancel).
OnText = Callable[[str], bool]


class Sampler:
    """A llama.cpp sampler chain built from SamplingParams (greedy at temperature 0)."""

    def __init__(self, params: SamplingParams) -> None:
        chain_params = llama_cpp.llama_sampler_chain_default_params()
        self._ptr = llama_cpp.llama_sampler_chain_init(chain_params)
        add = lambda s: llama_cpp.llama_sampler_chain_add(self._ptr, s)  # noqa: E731
        if params.temperature <= 0.0:
            add(llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(llama_cpp.llama_sampler_init_top_k(params.top_k))
            if params.top_p < 1.0:
                add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            add(llama_cpp.llama_sampler_init_temp(params.temperature))
            add(llama_cpp.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))

    def sample(self, ctx: Context) -> int:
        return int(llama_cpp.llama_sampler_sample(self._ptr, ctx.ptr, -1))

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_sampler_free(self._ptr)
            self._ptr = None


class StopMatcher:
    """Streams text while holding back any tail that could begin a stop string."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Returns the text that is safe to emit now."""
        buf = self._pending + text
        hits = [(buf.find(s), s) for s in self.stops if s in buf]
        if hits:
            self.stopped = True
            self._pending = ""
            return buf[: min(i for i, _ in hits)]
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(buf)), 0, -1):
                if buf.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def flush(self) -> str:
        out, self._pending = self._pending, ""
        return out


@dataclass(slots=True)
class Generation:
    text: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    first_token_s: float  # seconds from decode start to the first sampled token
    decode_s: float
    n_decoded: int  # leading tokens of ``tokens`` that were decoded into the KV cache


def generate(ctx: Context, n_past: int, params: SamplingParams,
             on_text: OnText | None = None) -> Generation:
    """Sample from the logits already in ``ctx`` (the prompt's last position is
    ``n_past - 1``) until EOG, a stop string, ``max_tokens`` or the callback says stop."""
    model = ctx.model
    sampler = Sampler(params)
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    stops = StopMatcher(params.stop)
    pieces: list[str] = []
    tokens: list[int] = []
    t0 = time.perf_counter()
    first_s = 0.0
    finish = "length"
    n_decoded = 0
    try:
        while len(tokens) < params.max_tokens:
            tok = sampler.sample(ctx)
            if not tokens:
                first_s = time.perf_counter() - t0
            if model.is_eog(tok):
                finish = "stop"
                break
            tokens.append(tok)
            emit = stops.feed(utf8.decode(model.token_bytes(tok)))
            if emit:
                pieces.append(emit)
                if on_text is not None and not on_text(emit):
                    finish = "cancelled"
                    break
            if stops.stopped:
                finish = "stop"
                break
            if n_past + len(tokens) >= ctx.n_ctx:
                break
            ctx.decode([tok], n_past + len(tokens) - 1)
            n_decoded += 1
        if finish != "cancelled":
            tail = stops.flush() + utf8.decode(b"", final=True) if not stops.stopped else ""
            if tail:
                pieces.append(tail)
                if on_text is not None:
                    on_text(tail)
    finally:
        sampler.close()
    return Generation("".join(pieces), tokens, finish, first_s, time.perf_counter() - t0, n_decoded)
