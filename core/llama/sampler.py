"""llama.cpp's sampler chain, built from :class:`SamplingParams` (greedy at temperature 0)."""

from __future__ import annotations

import llama_cpp

from core.llama.context import Context
from core.policies import SamplingParams


class SamplerChain:
    def __init__(self, params: SamplingParams) -> None:
        self._ptr = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        if params.temperature <= 0.0:
            self._add(llama_cpp.llama_sampler_init_greedy())
            return
        if params.top_k > 0:
            self._add(llama_cpp.llama_sampler_init_top_k(params.top_k))
        if params.top_p < 1.0:
            self._add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
        self._add(llama_cpp.llama_sampler_init_temp(params.temperature))
        self._add(llama_cpp.llama_sampler_init_dist(params.seed & 0xFFFFFFFF))

    def _add(self, sampler: llama_cpp.llama_sampler_p) -> None:
        llama_cpp.llama_sampler_chain_add(self._ptr, sampler)

    def sample(self, ctx: Context, idx: int = -1) -> int:
        """From the logits of batch index ``idx`` of the context's last batch."""
        return int(llama_cpp.llama_sampler_sample(self._ptr, ctx.ptr, idx))

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_sampler_free(self._ptr)
            self._ptr = None
