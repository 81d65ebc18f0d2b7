"""The windowed scoring prefill (core.kv.scoring_window) on tiny real models: it really
bounds what each token attends to, its result lands in the slot, a turn reports it,
and a cancelled one leaves the slot as it was."""

from __future__ import annotations

import numpy as np
import pytest

from core.chat import ChatTemplate
from core.kv.positions import SessionKV
from core.kv.scoring_window import SINKS, view_spans
from core.llama import seq_cells
from core.steps import drive
from tests.support import forced, with_sampling

from .test_session_engine import GREEDY, doc

WINDOW = 128
SPARSE = forced(mass=0.5, guard_user_tokens=16)


@pytest.fixture(scope="module")
def window_engine(tiny_target, tiny_speculator):
    from tests.conftest import _engine

    engine = _engine(tiny_target, tiny_speculator, scoring_window=WINDOW, slots=2)
    yield engine
    engine.close()


def k_rows(blob: bytes) -> list[np.ndarray]:
    """Each layer's K rows, one per cell, from a one-sequence saved state (llama.cpp's
    state_write_data with V not transposed: v_trans, n_layer, then per layer the K type,
    the row size and the rows)."""
    arr = np.frombuffer(blob, dtype=np.uint8)
    n_stream, off = int(arr[8:12].view("<u4")[0]), 12
    count = 0
    for _ in range(n_stream):
        count = int(arr[off:off + 4].view("<u4")[0])
        off += 4
        if count:
            break
    off += 12 * count  # pos, n_seq_id, seq_id per cell
    v_trans, n_layer = arr[off:off + 8].view("<u4")
    assert v_trans == 0
    off += 8
    out = []
    for _ in range(int(n_layer)):
        row = int(arr[off + 4:off + 12].view("<u8")[0])
        off += 12
        out.append(arr[off:off + row * count].reshape(count, row))
        off += row * count
    return out


def tokens(engine, n: int) -> list[int]:
    text = " ".join(doc(i, 30) for i in range(40))
    out = engine.speculator.tokenize(text, add_special=False)[:n]
    assert len(out) == n
    return out


def test_a_token_outside_the_window_does_not_reach_later_keys(window_engine):
    e = window_engine
    seq, n_batch = e.speculator_ctx.seq(1), e.config.n_batch
    assert e.speculator.n_layer == 2  # so a last-chunk key depends on what its own token attended to
    n = 2 * n_batch + 200
    first = tokens(e, n)
    second = list(first)
    second[SINKS + 40] = first[SINKS + 41]  # far before the last chunk's window
    tail = slice(2 * n_batch, n)  # the last chunk: it sees the sinks and the WINDOW cells before it
    windowed, dense = [], []
    for prompt in (first, second):
        seq.clear_cells()
        assert e.window.applies(0, n)
        drive(e.window.prefill(seq, prompt, 0))
        assert seq.pos_max() == n - 1 and e.window.ctx.seq_pos_max(0) == -1 and not e.window.busy
        windowed.append(k_rows(seq.save()))
        seq.clear_cells()
        seq.decode(prompt, 0, logits_last=False)
        dense.append(k_rows(seq.save()))
    seq.clear_cells()
    # layer 0's keys depend on the token alone; layer 1's on what that token attended to
    assert (windowed[0][0][tail] == windowed[1][0][tail]).all()
    assert (windowed[0][1][tail] == windowed[1][1][tail]).all()
    assert (dense[0][1][tail] != dense[1][1][tail]).any()  # without the window the change reaches them
    assert (windowed[0][1][:SINKS + 40] == dense[0][1][:SINKS + 40]).all()  # before the window binds: the same


def whole_context_windowed(e, seq, prompt: list[int], base: int) -> None:
    """The windowed prefill as it was first built: the slot's whole context in the scratch,
    masked down to the sinks and the window by the view."""
    full = e.window.ctx.seq(0)
    full.load_from(seq)
    for off in range(0, len(prompt), e.config.n_batch):
        part = prompt[off: off + e.config.n_batch]
        full.make_view(view_spans(base + off, WINDOW))
        full.view().decode(part, base + off, logits_last=False)
        full.commit_view(base + off, base + off + len(part))
    full.drop_view()
    seq.load_from(full)
    e.window.ctx.clear_cells()


def test_the_scratch_holds_the_sinks_and_the_window_alone_and_computes_what_the_whole_context_did(window_engine):
    e = window_engine
    seq, n_batch = e.speculator_ctx.seq(1), e.config.n_batch
    base, n = SINKS + 2 * WINDOW + 40, 3 * n_batch + 50  # the window passes new cells more than once
    prompt = tokens(e, base + n)
    seq.clear_cells()
    seq.decode(prompt[:base], 0, logits_last=False)
    before = seq.save()
    turn, held = e.window.prefill(seq, prompt[base:], base), []
    req = turn.send(None)
    while True:
        req.seq.decode(req.tokens, req.start_pos, logits_last=False)
        held.append(len(seq_cells.parse(e.window.ctx.seq(0).save(), 0)))
        assert seq.save() == before  # the slot is written once, at the end
        try:
            req = turn.send(-1)
        except StopIteration:
            break
    compact = seq_cells.parse(seq.save(), seq.id)
    seq.load_state(before)
    whole_context_windowed(e, seq, prompt[base:], base)
    whole = seq_cells.parse(seq.save(), seq.id)
    seq.clear_cells()
    assert max(held) <= SINKS + WINDOW + 2 * n_batch < base + n
    assert compact.positions.tolist() == whole.positions.tolist() == list(range(base + n))
    for mine, theirs in zip(compact.k + compact.v, whole.k + whole.v, strict=True):
        a, b = (x.view("<f2").astype(np.float32) for x in (mine, theirs))
        # the same attention, summed in another order: a few ulps (layer 0's keys are exact)
        assert np.abs(a - b).max() <= 1e-2 * np.abs(b).max()
    assert (compact.k[0] == whole.k[0]).all()


def test_a_long_turn_scores_through_the_window_and_the_next_turn_reuses_it(window_engine):
    e = window_engine
    chat, kv = ChatTemplate(e.target), SessionKV()
    e.slot_cells.load(None)
    msgs = [{"role": "user", "content": " ".join(doc(i, 30) for i in range(4)) + " Which sensor read most?"}]
    prompt = chat.render(msgs)
    assert len(prompt) > SINKS + WINDOW + e.config.n_batch
    r1 = e.run(prompt, with_sampling(SPARSE, GREEDY), kv=kv)
    assert r1.timings.specprefill == "active"
    assert r1.timings.speculator_windowed_n == len(prompt) - 1  # the last token is scored in full, apart
    assert kv.speculator.tokens == list(prompt.tokens)
    assert e.speculator_ctx.seq(0).pos_max() == len(prompt) - 1
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": "And the least?"}]
    p2 = chat.render(msgs)
    r2 = e.run(p2, with_sampling(SPARSE, GREEDY), kv=kv)
    assert r2.timings.speculator_cache_n == len(prompt) and r2.timings.speculator_windowed_n == 0
    assert kv.speculator.tokens == list(p2.tokens)


def test_a_cancelled_windowed_prefill_leaves_the_slot_as_it_was(window_engine):
    e = window_engine
    seq = e.speculator_ctx.seq(1)
    seq.clear_cells()
    prompt = tokens(e, 3 * e.config.n_batch)
    seq.decode(prompt[:100], 0, logits_last=False)
    before = seq.save()
    turn = e.window.prefill(seq, prompt[100:], 100)
    req = turn.send(None)
    req.seq.decode(req.tokens, req.start_pos, logits_last=False)
    assert turn.send(-1) is not None  # the second chunk is asked for
    turn.close()  # the turn is cancelled there
    assert seq.save() == before
    assert e.window.ctx.seq_pos_max(0) == -1 and e.window.ctx.seq_pos_max(e.window.ctx.view_seq) == -1
    assert not e.window.busy
    seq.clear_cells()


def test_idle_time_reserves_the_buffers_a_deep_turn_copies_through(window_engine):
    e = window_engine
    target, scorer = e.target_ctx.seq(1), e.speculator_ctx.seq(1)
    prompt = tokens(e, 300)
    for seq in (target, scorer):
        seq.clear_cells()
        seq.decode(prompt, 0, logits_last=False)
    assert e.target_ctx.private_cells  # split streams: a bridge moves a label through the saved state
    assert e.reserve_buffers(1)
    held = len(e.target_ctx.move_buffer)
    assert held >= target.state_size() * 5 // 4
    assert not e.reserve_buffers(1)  # room enough: nothing grows twice
    target.move_labels({299: 305})
    target.move_labels({305: 299})
    assert len(e.target_ctx.move_buffer) == held and target.pos_max() == 299  # the moves found their pages there
    for seq in (target, scorer):
        seq.clear_cells()
