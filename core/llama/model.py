"""A loaded GGUF model: its metadata, tokenizer and vocabulary."""

from __future__ import annotations

import ctypes
from typing import Any

import llama_cpp

from core.errors import ModelFileError
from core.llama.backend import init_backend
from core.llama.gguf_file import validate_gguf


class Model:
    """A loaded GGUF model: tokenizer, metadata, and a factory for contexts."""

    def __init__(self, path: str) -> None:
        self.path = validate_gguf(path)
        init_backend()
        params = llama_cpp.llama_model_default_params()
        params.n_gpu_layers = 0
        self._ptr = llama_cpp.llama_model_load_from_file(str(self.path).encode(), params)
        if not self._ptr:
            raise ModelFileError(f"llama.cpp could not load {self.path}")
        self.vocab = llama_cpp.llama_model_get_vocab(self._ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_layer = llama_cpp.llama_model_n_layer(self._ptr)
        self.n_head = llama_cpp.llama_model_n_head(self._ptr)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(self._ptr)
        self.size_bytes = self.path.stat().st_size
        head_dim = llama_cpp.llama_model_n_embd(self._ptr) // max(1, self.n_head)
        # f16 K and V of every layer: what one cached token costs a context
        self.kv_bytes_per_token = 2 * 2 * self.n_layer * llama_cpp.llama_model_n_head_kv(self._ptr) * head_dim

    def close(self) -> None:
        if self._ptr:
            llama_cpp.llama_model_free(self._ptr)
            self._ptr = None

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(1 << 16)
        n = llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        if n < 0:
            return None
        if n >= len(buf):
            buf = ctypes.create_string_buffer(n + 1)
            llama_cpp.llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode("utf-8", "replace")

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        raw = text.encode("utf-8")
        cap = len(raw) + 16
        arr = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), arr, cap, add_special, parse_special)
        if n < 0:
            arr = (llama_cpp.llama_token * -n)()
            n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), arr, -n, add_special, parse_special)
        return list(arr[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: list[int] | tuple[int, ...], special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special) for t in tokens).decode("utf-8", "replace")

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def rope_params(self) -> dict[str, Any] | None:
        """What applying this model's rotary embedding again to saved K takes (core.kv.rope),
        when it is plain NORM or NEOX RoPE without YaRN or other context scaling; else None."""
        kind = llama_cpp.llama_model_rope_type(self._ptr)
        arch = self.meta("general.architecture") or ""
        if kind not in (llama_cpp.LLAMA_ROPE_TYPE_NORM, llama_cpp.LLAMA_ROPE_TYPE_NEOX) or \
                self.meta(f"{arch}.rope.scaling.type") not in (None, "none", "linear"):
            return None
        head_dim = int(self.meta(f"{arch}.attention.key_length")
                       or llama_cpp.llama_model_n_embd(self._ptr) // max(1, self.n_head))
        return {"n_head_kv": llama_cpp.llama_model_n_head_kv(self._ptr), "head_dim": head_dim,
                "n_rot": int(self.meta(f"{arch}.rope.dimension_count") or head_dim),
                "freq_base": float(self.meta(f"{arch}.rope.freq_base") or 10000.0),
                "freq_scale": float(llama_cpp.llama_model_rope_freq_scale_train(self._ptr)),
                "neox": kind == llama_cpp.LLAMA_ROPE_TYPE_NEOX}
