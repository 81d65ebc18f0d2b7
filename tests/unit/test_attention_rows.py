"""The flash capture's softmax rows (core.llama.attention_rows), against a plain
per-head reference."""

from __future__ import annotations

import numpy as np
import pytest

from core.llama.attention_rows import Q8_0_BLOCK, FlashInputs, attention_rows, dequantize_q8_0, round_q8_0

RNG = np.random.default_rng(7)


def inputs(n_head=4, n_head_kv=2, n_tokens=3, n_kv=12, d=8, softcap=0.0, masked=(3, 9, 10, 11)) -> FlashInputs:
    mask = np.zeros((n_tokens + 1, n_kv), dtype=np.float16)  # padded rows, as llama.cpp pads
    mask[:, list(masked)] = -np.inf
    return FlashInputs(q=RNG.normal(size=(n_head, n_tokens, d)).astype(np.float32),
                       k=RNG.normal(size=(n_head_kv, n_kv, d)).astype(np.float16),
                       mask=mask, scale=d ** -0.5, softcap=softcap)


def reference(x: FlashInputs) -> np.ndarray:
    group = x.q.shape[0] // x.k.shape[0]
    out = []
    for h in range(x.q.shape[0]):
        q = x.q[h, -1].astype(np.float16).astype(np.float64)
        s = x.k[h // group].astype(np.float64) @ q * x.scale
        if x.softcap:
            s = x.softcap * np.tanh(s / x.softcap)
        s = s + x.mask[x.q.shape[1] - 1]
        e = np.exp(s - s.max())
        out.append(e / e.sum())
    return np.array(out)


@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_rows_equal_a_per_head_softmax(softcap):
    x = inputs(softcap=softcap)
    rows = attention_rows(x)
    assert rows.shape == (4, 12) and rows.dtype == np.float32
    np.testing.assert_allclose(rows, reference(x), rtol=1e-5, atol=1e-7)
    assert (rows[:, [3, 9, 10, 11]] == 0).all()
    np.testing.assert_allclose(rows.sum(axis=1), 1.0, rtol=1e-6)


def test_query_heads_read_their_group_kv_head():
    x = inputs(n_head=4, n_head_kv=2)
    k = x.k.copy()
    k[1] = 0  # heads 2 and 3 read KV head 1: their logits are all 0, so uniform over unmasked keys
    rows = attention_rows(FlashInputs(x.q, k, x.mask, x.scale))
    uniform = np.where(np.isin(np.arange(12), [3, 9, 10, 11]), 0, 1 / 8)
    np.testing.assert_allclose(rows[2:], np.stack([uniform, uniform]), atol=1e-7)
    assert not np.allclose(rows[0], rows[2])


def test_a_row_with_every_key_masked_is_zero_not_nan():
    x = inputs(masked=tuple(range(12)))
    assert (attention_rows(x) == 0).all()


def test_inconsistent_shapes_are_refused():
    x = inputs()
    with pytest.raises(ValueError, match="GQA"):
        FlashInputs(x.q[:3], x.k, x.mask, x.scale)
    with pytest.raises(ValueError, match="mask"):
        FlashInputs(x.q, x.k, x.mask[:, :5], x.scale)


def test_q8_0_rounding_follows_ggml_quantize_row_q8_0():
    block = np.linspace(-2.0, 1.0, 32, dtype=np.float32)  # max |x| = 2: scale 2/127
    d = np.float32(np.float16(2.0 / 127))
    np.testing.assert_allclose(round_q8_0(block[None]), np.round(block / (2.0 / 127))[None] * d, rtol=0, atol=0)
    assert (round_q8_0(np.zeros((2, 64), np.float32)) == 0).all()  # a zero block has scale 0, not NaN
    two = np.concatenate([block, 100 * block])[None]  # each block of 32 has its own scale
    np.testing.assert_allclose(round_q8_0(two)[0, 32:] / 100, round_q8_0(block[None])[0], rtol=1e-3)


def test_q8_0_blocks_dequantize_to_scale_times_values():
    blocks = np.zeros((2, 3), dtype=Q8_0_BLOCK)
    blocks["d"] = np.float16(0.5)
    blocks["qs"][1, 2] = np.arange(-16, 16)
    out = dequantize_q8_0(blocks)
    assert out.shape == (2, 96) and out.dtype == np.float32
    np.testing.assert_array_equal(out[1, 64:], 0.5 * np.arange(-16, 16))
    assert (out[0] == 0).all() and (out[1, :64] == 0).all()


def test_a_q8_0_cache_rounds_the_query_to_q8_0_blocks():
    x = inputs(d=64)
    k = round_q8_0(x.k.astype(np.float32))  # a q8_0 cache, dequantized
    rows = attention_rows(FlashInputs(x.q, k, x.mask, x.scale, k_type="q8_0"))
    group = x.q.shape[0] // k.shape[0]
    q = round_q8_0(x.q[:, -1])
    want = []
    for h in range(x.q.shape[0]):
        s = k[h // group].astype(np.float64) @ q[h] * x.scale + x.mask[x.q.shape[1] - 1]
        want.append(np.exp(s - s.max()) / np.exp(s - s.max()).sum())
    np.testing.assert_allclose(rows, np.array(want), rtol=1e-5, atol=1e-7)
    unrounded = attention_rows(FlashInputs(x.q, k, x.mask, x.scale, k_type="f32"))
    assert np.abs(rows - unrounded).max() > 1e-6  # the rounding is applied, not skipped
    with pytest.raises(ValueError, match="k_type"):
        FlashInputs(x.q[..., :40], k[..., :40], x.mask, x.scale, k_type="q8_0")  # not whole blocks
