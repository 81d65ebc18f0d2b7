"""The last query's softmax row over the keys of one attention layer, as llama.cpp's
``kq_soft_max`` holds it, from the inputs of a flash-attention node (pure numpy; the
ctypes side that reads those inputs is core.llama.tensors)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(slots=True, frozen=True)
class FlashInputs:
    """One flash-attention node's inputs for one stream, in llama.cpp's layouts:
    ``q`` [n_head, n_tokens, head_dim] (post-RoPE), ``k`` [n_head_kv, n_kv, head_dim]
    (the cache cells the node attends: f16 as stored, or a q8_0 cache dequantized),
    ``mask`` [n_tokens_pad, n_kv] (0 or -inf), the node's ``scale`` and ``softcap``, and
    the cache's element type ``k_type`` (``f32``, ``f16`` or ``q8_0``)."""

    q: np.ndarray
    k: np.ndarray
    mask: np.ndarray
    scale: float
    softcap: float = 0.0
    k_type: str = "f16"

    def __post_init__(self) -> None:
        if self.q.ndim != 3 or self.k.ndim != 3 or self.mask.ndim != 2:
            raise ValueError(f"shapes q{self.q.shape} k{self.k.shape} mask{self.mask.shape}: want 3, 3, 2 dims")
        n_head, n_head_kv = self.q.shape[0], self.k.shape[0]
        if n_head_kv == 0 or n_head % n_head_kv or self.q.shape[2] != self.k.shape[2]:
            raise ValueError(f"q{self.q.shape} and k{self.k.shape} do not share a head size and GQA grouping")
        if self.mask.shape[0] < self.q.shape[1] or self.mask.shape[1] != self.k.shape[1]:
            raise ValueError(f"mask{self.mask.shape} does not cover q{self.q.shape} x k{self.k.shape}")
        if self.k_type not in ("f32", "f16", "q8_0") or (self.k_type == "q8_0" and self.q.shape[2] % 32):
            raise ValueError(f"k_type {self.k_type!r} with head size {self.q.shape[2]}")


Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])  # ggml's block_q8_0: an f16 scale, 32 int8s


def dequantize_q8_0(blocks: np.ndarray) -> np.ndarray:
    """q8_0 blocks [..., n_blocks] as float32 [..., n_blocks * 32] (scale x int8, as ggml does)."""
    values = blocks["d"].astype(np.float32)[..., None] * blocks["qs"].astype(np.float32)
    return values.reshape(*blocks.shape[:-1], -1)


def round_q8_0(x: np.ndarray) -> np.ndarray:
    """``x`` rounded as ggml's ``quantize_row_q8_0`` stores it, then dequantized: per block of
    32 along the last axis, scale = max|x| / 127 (kept as f16), values = round(x / scale)."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 32)
    d = np.abs(blocks).max(axis=-1, keepdims=True) / 127.0
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d > 0)
    q = np.round(blocks * inv)  # nearest, ties to even, as the SIMD quantizer rounds
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape)


def attention_rows(inputs: FlashInputs) -> np.ndarray:
    """The last query token's attention weights per head: [n_head, n_kv], float32.

    As llama.cpp computes them: query head h reads KV head ``h // (n_head / n_head_kv)``;
    the query is rounded to the cache's type (f16, or q8_0 blocks: the CPU's dot product
    converts it so);
    logits are ``q.k * scale`` (with a soft cap: ``softcap * tanh(q.k * scale / softcap)``)
    plus the mask, then a max-subtracted softmax in f32.  Masked keys get exactly 0."""
    q = inputs.q[:, -1, :]
    if inputs.k_type == "f16":
        q = q.astype(np.float16)
    elif inputs.k_type == "q8_0":
        q = round_q8_0(q)
    group = q.shape[0] // inputs.k.shape[0]
    k = inputs.k.astype(np.float32)
    q32 = q.astype(np.float32).reshape(inputs.k.shape[0], group, -1)
    logits = np.einsum("gjd,ghd->ghj", k, q32).reshape(q.shape[0], -1)
    if inputs.softcap:
        logits = inputs.softcap * np.tanh(logits * (inputs.scale / inputs.softcap))
    else:
        logits *= inputs.scale
    logits += inputs.mask[inputs.q.shape[1] - 1].astype(np.float32)
    top = logits.max(axis=1, keepdims=True)
    with np.errstate(invalid="ignore"):
        e = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
    total = e.sum(axis=1, keepdims=True)
    return np.divide(e, total, out=np.zeros_like(e), where=total > 0).astype(np.float32)
