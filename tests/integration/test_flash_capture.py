"""The flash-attention capture (the scoring model runs with flash attention on, and the
rows are recomputed from each attention node's inputs) against llama.cpp's own
``kq_soft_max`` rows on a context without it: same prompt, every layer and head."""

from __future__ import annotations

import numpy as np
import pytest

from core.kv.sparse_prefill import sparse_prefill
from core.llama.capture import AttentionCapture, FlashCapture
from core.llama.context import Context
from core.llama.model import Model
from core.policies import Selection
from core.specprefill.scoring import importance
from core.specprefill.selection import select_tokens
from core.steps import drive

N_UBATCH = 64  # so the prompts below span several ubatches
# Layer 0 reads the same queries and keys in both contexts, so its rows must agree to float
# rounding.  Deeper layers read keys computed from flash attention's own output, which
# differs from the plain path's by rounding (on the CPU it accumulates V in f16): measured
# on these models, up to 7e-3 on one weight and 0.025 of L1 distance per row.
LAYER0_ATOL, LAYER0_RTOL = 5e-5, 1e-3
ROW_L1 = 0.05


def open_pair(model_path, kv_type: str):
    """A softmax-capture and a flash-capture context of one model; with ``q8_0`` both hold
    K as q8_0 (V too where flash attention runs)."""
    model = Model(str(model_path))
    contexts = [Context(model, n_ctx=1024, n_batch=256, n_ubatch=N_UBATCH, n_threads=2, flash_attn=c.flash_attn,
                        capture=c, n_seq=2, unified=False, kv_type=kv_type)
                for c in (AttentionCapture(model.n_layer), FlashCapture(model.n_layer))]
    yield tuple(contexts)
    for ctx in contexts:
        ctx.close()
    model.close()


@pytest.fixture(scope="module")
def pair(tiny_speculator):
    yield from open_pair(tiny_speculator, "f16")


@pytest.fixture(scope="module")
def q8_pair(tiny_speculator):
    yield from open_pair(tiny_speculator, "q8_0")


def prompt(ctx: Context, n: int) -> list[int]:
    text = " ".join(f"Line {i}: bay {i % 7} holds {i * 3} crates of lamps." for i in range(n))
    return ctx.model.tokenize(text)


def capture_last(ctx: Context, slot: int, history: list[int], kept: np.ndarray | None) -> np.ndarray:
    """Prefill ``history[:-1]`` (or only its ``kept`` tokens, at their positions) in
    ``slot``, then decode the last token with the capture on: [n_layer, n_head, n_cells]."""
    seq = ctx.seq(slot)
    seq.clear_cells()
    if kept is None:
        seq.decode(history[:-1], 0, logits_last=False)
        n_cells = len(history)
    else:
        drive(sparse_prefill(seq, history[:-1], kept, "original", 0))
        n_cells = kept.size + 1
    assert ctx.capture is not None
    ctx.capture.start(n_cells)
    try:
        seq.decode([history[-1]], len(history) - 1)
    finally:
        rows = ctx.capture.stop()
    return rows


def assert_rows_match(softmax: np.ndarray, flash: np.ndarray, row_l1: float = ROW_L1) -> None:
    assert flash.shape == softmax.shape
    np.testing.assert_allclose(flash[0], softmax[0], atol=LAYER0_ATOL, rtol=LAYER0_RTOL)
    assert np.abs(flash - softmax).sum(axis=2).max() < row_l1  # every layer and head
    np.testing.assert_allclose(flash.sum(axis=2), 1.0, atol=1e-4)  # each head's row is a distribution
    # what scoring reads: the same tokens, chunk for chunk
    n = softmax.shape[2]
    a = select_tokens(importance([softmax], n, 13, 4, 1.5, 8, 1.5), Selection())
    b = select_tokens(importance([flash], n, 13, 4, 1.5, 8, 1.5), Selection())
    assert len(set(a) ^ set(b)) <= 0.05 * len(set(a) | set(b)), (len(a), len(b))


def test_rows_match_kq_soft_max_over_several_ubatches(pair):
    softmax_ctx, flash_ctx = pair
    tokens = prompt(softmax_ctx, 40)
    assert len(tokens) > 4 * N_UBATCH
    assert_rows_match(capture_last(softmax_ctx, 0, tokens, None), capture_last(flash_ctx, 0, tokens, None))


def test_rows_read_from_a_q8_0_cache_match_kq_soft_max(q8_pair, pair):
    """A q8_0 K cache is read as blocks and dequantized, and the query rounded as the CPU's
    q8_0 dot product rounds it: layer 0 agrees to float rounding.  Only the flash context
    holds V as q8_0 too, so deeper layers read keys from outputs that differ by V's
    quantization (measured: 0.13 of L1 distance on the worst row of this model)."""
    softmax_ctx, flash_ctx = q8_pair
    tokens = prompt(softmax_ctx, 40)
    softmax = capture_last(softmax_ctx, 0, tokens, None)
    flash = capture_last(flash_ctx, 0, tokens, None)
    assert_rows_match(softmax, flash, row_l1=0.25)
    f16 = capture_last(pair[1], 0, tokens, None)
    assert np.abs(f16[0] - flash[0]).max() > 1e-5  # the q8_0 keys were read, not an f16 copy


def test_rows_match_on_a_mirrored_sparse_sequence_in_the_second_slot(pair):
    softmax_ctx, flash_ctx = pair
    tokens = prompt(softmax_ctx, 40)
    n = len(tokens) - 1
    kept = np.concatenate([np.arange(0, 30), np.arange(90, 170), np.arange(n - 40, n)])
    for ctx in pair:  # the other slot holds a different sequence: its cells must get no weight
        ctx.seq(0).clear_cells()
        ctx.seq(0).decode(prompt(ctx, 12), 0, logits_last=False)
    softmax = capture_last(softmax_ctx, 1, tokens, kept)
    flash = capture_last(flash_ctx, 1, tokens, kept)
    assert softmax.shape[2] == kept.size + 1
    assert_rows_match(softmax, flash)


def test_flash_capture_sees_the_rows_of_the_token_decoded_last(pair):
    """Two different last tokens give different rows: the capture is not reading stale data."""
    _, flash_ctx = pair
    tokens = prompt(flash_ctx, 20)
    a = capture_last(flash_ctx, 0, tokens, None)
    b = capture_last(flash_ctx, 0, tokens[:-1] + [tokens[5]], None)
    assert np.abs(a - b).max() > 1e-3
