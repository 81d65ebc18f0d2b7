"""The flash capture's softmax rows (core.llama.attention_rows), against a plain
per-head reference."""

from __future__ import annotations

import numpy as np
import pytest

from core.llama.attention_rows import FlashInputs, attention_rows

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
