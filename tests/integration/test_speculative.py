"""Speculative decoding and SpecAttn verification on real (small) models.

Greedy output must equal plain target decoding token for token; sparse views must
never corrupt a session's caches."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from core import constraints
from core.kv.positions import SessionKV
from core.policies import SamplingParams
from tests.support import forced, policy, with_sampling

PLAIN = policy(enabled=False)
SPECULATIVE = policy(enabled=False, speculative=True)
STORY = [{"role": "user", "content": "Write a short story about a robot who learns to paint. " * 3}]


def run(engine, messages, policy, sampling, kv=None):
    return engine.run(engine.chat.render(messages), with_sampling(policy, sampling), kv=kv)


@pytest.mark.parametrize("policy", [SPECULATIVE, policy(enabled=False, specattn=True, specattn_p=1.0),
                                    policy(enabled=False, speculative=True, gamma=1)],
                         ids=["dense-verify", "specattn-p1", "gamma1"])
def test_greedy_speculative_equals_plain_decoding(smol_pair_engine, policy):
    greedy = SamplingParams(max_tokens=48)
    plain = run(smol_pair_engine, STORY, PLAIN, greedy)
    speculative = run(smol_pair_engine, STORY, policy, greedy)
    assert speculative.tokens == plain.tokens and speculative.text == plain.text
    t = speculative.timings.speculative
    assert speculative.timings.decode_mode == policy.decoding.mode
    assert 0 < t.n_accepted < t.n_drafted  # the truncated draft is right sometimes, not always
    assert t.cells_attended == t.cells_total  # p=1 (or dense) attends every cell


WEATHER = {"type": "object", "properties": {"city": {"type": "string"}, "level": {"type": "integer"},
                                         "note": {"type": "string"}}, "required": ["city", "level", "note"]}
ALARM = {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm.", "parameters": {
    "type": "object", "properties": {"unit": {"type": "integer"}, "reason": {"type": "string"}},
    "required": ["unit", "reason"]}}}
ASK = [{"role": "user", "content": "Unit 7 overheated in Oslo at level 4. Report it as JSON, with a note."}]


@pytest.mark.parametrize("policy", [SPECULATIVE, policy(enabled=False, specattn=True, specattn_p=1.0)],
                         ids=["speculative", "specattn-p1"])
@pytest.mark.parametrize("kind", ["json_schema", "tool_call"])
def test_constrained_speculative_decoding_equals_plain_constrained_decoding(smol_pair_engine, policy, kind):
    """Drafts sampled under the grammar's mask, rows verified in the state their drafts lead
    to, the matcher rolled back over rejected drafts: the same tokens as plain decoding under
    the same constraint, and a reply the grammar accepts."""
    constraint = constraints.json_reply(WEATHER) if kind == "json_schema" else \
        constraints.tool_call([ALARM], "required", False, constraints.SYNTAXES["qwen"])
    held = SamplingParams(max_tokens=64, constraint=constraint)
    plain = run(smol_pair_engine, ASK, PLAIN, held)
    speculative = run(smol_pair_engine, ASK, policy, held)
    assert speculative.tokens == plain.tokens and speculative.text == plain.text
    t = speculative.timings
    assert t.decode_mode == policy.decoding.mode and t.constraint == kind and t.mask_ms > 0
    assert 0 < t.speculative.n_accepted < t.speculative.n_drafted  # rounds both accepted and rejected drafts
    free = run(smol_pair_engine, ASK, PLAIN, SamplingParams(max_tokens=64))
    assert free.tokens != plain.tokens  # the grammar shaped the reply
    if kind == "json_schema":
        assert speculative.finish_reason == "stop"  # the grammar ended it (EOS drafted or forced)
        assert set(json.loads(speculative.text)) == {"city", "level", "note"}
    else:
        assert "set_alarm" in speculative.text


def test_identical_draft_is_almost_always_accepted(smol_engine):
    """The draft's context runs without flash attention (capture needs it off), so at the
    story's near-ties its argmax can differ from the target's; one draft a round keeps each
    such flip to one rejected token (with gamma 4 one flip also rejects the drafts after it)."""
    greedy = SamplingParams(max_tokens=40)
    plain = run(smol_engine, STORY, PLAIN, greedy)
    speculative = run(smol_engine, STORY, policy(enabled=False, speculative=True, gamma=1), greedy)
    assert speculative.tokens == plain.tokens
    assert speculative.timings.speculative.accept_rate > 0.85
    assert speculative.timings.speculative.n_drafted >= len(speculative.tokens) // 2 - 1  # a round: 1 or 2 tokens


def test_speculative_respects_max_tokens_and_stop(smol_pair_engine):
    plain = run(smol_pair_engine, STORY, PLAIN, SamplingParams(max_tokens=7))
    speculative = run(smol_pair_engine, STORY, SPECULATIVE, SamplingParams(max_tokens=7))
    assert speculative.tokens == plain.tokens and len(speculative.tokens) == 7 and speculative.finish_reason == "length"
    word = plain.text.split()[3]
    stopped = run(smol_pair_engine, STORY, SPECULATIVE, SamplingParams(max_tokens=40, stop=(word,)))
    assert stopped.finish_reason == "stop" and word not in stopped.text
    assert plain.text.startswith(stopped.text)


def test_sampled_speculative_decoding_is_seeded(smol_pair_engine):
    hot = SamplingParams(max_tokens=24, temperature=0.9, seed=11)
    a = run(smol_pair_engine, STORY, SPECULATIVE, hot)
    b = run(smol_pair_engine, STORY, SPECULATIVE, hot)
    c = run(smol_pair_engine, STORY, SPECULATIVE, SamplingParams(max_tokens=24, temperature=0.9, seed=12))
    assert a.tokens == b.tokens and len(a.tokens) == 24
    assert a.tokens != c.tokens


def relogit_last(ctx, tokens: list[int]) -> np.ndarray:
    """Decode the last token again on top of the cache's other cells."""
    ctx.remove_from(len(tokens) - 1)
    ctx.decode([tokens[-1]], len(tokens) - 1)
    return ctx.logits()


def fresh_logits(ctx, tokens: list[int]) -> np.ndarray:
    ctx.clear_cells()
    ctx.decode(tokens, 0)
    return ctx.logits()


@pytest.mark.parametrize("p", [0.5, 0.9])
def test_sparse_view_never_corrupts_the_session(smol_pair_engine, p):
    """A SpecAttn turn at low p changes what the target attends to, never what it holds:
    afterwards the target holds exactly the session's tokens (the reply's K/V computed
    through the views, as SpecAttn does), its prompt cells are untouched, and the draft
    gives a fresh dense prefill's logits."""
    e = smol_pair_engine
    kv = SessionKV()
    e.slot_cells.load(None)
    prompt = e.chat.render(STORY).tokens
    first = run(e, STORY, policy(enabled=False, specattn=True, specattn_p=p), SamplingParams(max_tokens=30),
                kv=kv)
    t = first.timings.speculative
    assert 0 < t.cells_attended < t.cells_total
    assert kv.speculator.tokens == kv.target.tokens  # the draft is in step with the target
    assert kv.target.tokens[: len(prompt)] == list(prompt)
    assert kv.target.kv_pos == list(range(len(kv.target.tokens)))
    target = e.target_ctx.seq(0)
    assert target.pos_max() == len(kv.target.tokens) - 1 and e.target_ctx.seq_pos_max(1) == -1  # view gone
    checks = ((e.speculator_ctx.seq(0), kv.speculator.tokens), (target, list(prompt)))
    for ctx, tokens in checks:
        kept, fresh = relogit_last(ctx, tokens), fresh_logits(ctx, tokens)
        assert int(np.argmax(kept)) == int(np.argmax(fresh))
        assert np.abs(kept - fresh).max() < 0.05 * (fresh.max() - fresh.min())


def test_qk_probe_reproduces_llama_attention(tiny_target):
    """Keys and queries from the flash-attention probe give the softmax rows that the
    non-flash context's kq_soft_max holds (the Quest-style eval baseline relies on it)."""
    from core.llama.capture import AttentionCapture, QKCapture
    from core.llama.context import Context
    from core.llama.model import Model

    model = Model(str(tiny_target))
    tokens = model.tokenize("The quick brown fox jumps over the lazy dog. " * 12)
    n = len(tokens)
    att, probe = AttentionCapture(model.n_layer), QKCapture(model.n_layer)
    plain = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, flash_attn=False, capture=att)
    flash = Context(model, n_ctx=256, n_batch=64, n_ubatch=64, n_threads=2, flash_attn=True, views=True,
                    probe=probe)
    try:
        plain.decode(tokens[:-1], 0)
        att.start(n)
        plain.decode(tokens[-1:], n - 1)
        rows = att.stop()  # [n_layer, n_head, n]
        probe.start_keys()
        flash.decode(tokens[:-1], 0)  # several ubatches of 64
        keys = probe.stop_keys()  # [n_layer, n_kv, n-1, d]
        probe.start_query()
        flash.decode(tokens[-1:], n - 1)
        q = probe.stop_query()  # [n_layer, n_head, d]
        probe.start_keys()
        flash.seq().remove_from(n - 1)
        flash.decode(tokens[-1:], n - 1)
        k_last = probe.stop_keys()
    finally:
        plain.close()
        flash.close()
        model.close()
    k = np.concatenate([keys, k_last], axis=2)
    assert k.shape[2] == n
    group = q.shape[1] // k.shape[1]
    scores = np.einsum("lhd,lhnd->lhn", q, np.repeat(k, group, axis=1)) / np.sqrt(q.shape[-1])
    soft = np.exp(scores - scores.max(-1, keepdims=True))
    soft /= soft.sum(-1, keepdims=True)
    assert np.abs(soft - rows).max() < 0.02


def test_view_masks_attention_and_commits_only_chosen_cells(small_model):
    """A batch through a view must attend to the view alone (llama.cpp masks by the first
    seq id), and only committed cells may stay in the sequence afterwards."""
    from core.llama.context import VIEW_SEQ, Context
    from core.llama.model import Model

    model = Model(str(small_model))
    ctx = Context(model, n_ctx=512, n_batch=256, n_ubatch=256, n_threads=2, flash_attn=True, views=True)
    seq = ctx.seq(0)
    try:
        tokens = model.tokenize("The capital of France is Paris. The capital of Japan is Tokyo. " * 8)
        n = len(tokens)
        ctx.decode(tokens, 0)

        def second_logits(spans):
            if spans is not None:
                seq.make_view(spans)
            ctx.decode([5, 6], n, logits_all=True, seqs=(VIEW_SEQ,) if spans is not None else (0,))
            return ctx.logits_at(1)

        dense = second_logits(None)
        seq.remove_from(n)
        full_view = second_logits([(0, n)])
        seq.drop_view()
        narrow = second_logits([(0, 4), (n - 1, n)])
        seq.commit_view(n, n + 1)  # keep the first new cell only
        seq.drop_view()
        assert np.abs(full_view - dense).max() < 0.05 * (dense.max() - dense.min())
        assert np.abs(narrow - dense).max() > 1.0  # a 5-cell view really changes the result
        assert seq.pos_max() == n and ctx.seq_pos_max(VIEW_SEQ) == -1
    finally:
        ctx.close()
        model.close()


def test_low_p_verify_really_attends_through_the_view(smol_pair_engine):
    """At p = 0.3 the target verifies against ~6% of the cells, which changes the greedy
    reply; were the view not applied (e.g. a batch tagged [1, 0], which attends to all of
    seq 0), the reply would equal dense verification's."""
    greedy = SamplingParams(max_tokens=48)
    dense = run(smol_pair_engine, STORY, SPECULATIVE, greedy)
    sparse = run(smol_pair_engine, STORY, policy(enabled=False, specattn=True, specattn_p=0.3), greedy)
    assert sparse.timings.speculative.selected_frac < 0.2
    assert sparse.tokens != dense.tokens


@pytest.mark.parametrize("decoding", [SPECULATIVE, policy(enabled=False, specattn=True, specattn_p=1.0)],
                         ids=["dense-verify", "specattn-p1"])
def test_speculative_decoding_on_a_mirrored_draft_equals_plain_decoding(smol_pair_engine, decoding):
    """After a sparse turn and a scored turn that rebuilt the draft as the target's mirror,
    the draft holds fewer cells than positions: its attention columns must still map to the
    right target cells (SpecAttn at p = 1 selects every one of them)."""
    from core.specprefill.cost_model import PrefillCost

    e = smol_pair_engine
    kv = SessionKV()
    e.slot_cells.load(None)
    sparse = forced(mass=0.5, guard_user_tokens=16)
    doc = " ".join(f"Entry {k}: the pump at site {k % 7} logged {k * 13 % 97} litres." for k in range(40))
    msgs = [{"role": "user", "content": doc + " Which site logged most?"}]
    r1 = run(e, msgs, sparse, SamplingParams(max_tokens=8), kv)
    msgs += [{"role": "assistant", "content": r1.text}, {"role": "user", "content": doc + " And least?"}]
    saved_cost, e.costs.speculator = e.costs.speculator, PrefillCost(coef=np.array([1e-4, 1e-4, 0.0]))
    try:
        r2 = run(e, msgs, sparse, SamplingParams(max_tokens=8), kv)
    finally:
        e.costs.speculator = saved_cost
    assert r2.timings.speculator_mirrored_n > 0 and -1 in kv.speculator.kv_pos
    msgs += [{"role": "assistant", "content": r2.text}, {"role": "user", "content": "Tell me a story about it."}]
    blobs, kv_copy = e.slot_cells.save(), SessionKV(copy.deepcopy(kv.target), copy.deepcopy(kv.speculator))
    greedy = SamplingParams(max_tokens=40)
    plain = run(e, msgs, PLAIN, greedy, kv_copy)
    e.slot_cells.load(blobs)
    speculative = run(e, msgs, decoding, greedy, kv)
    assert speculative.tokens == plain.tokens
    t = speculative.timings.speculative
    assert t.n_drafted > 0 and t.cells_attended == t.cells_total


def test_decode_auto_takes_the_mode_measured_faster_at_the_depth(smol_pair_engine):
    """``decode_auto``: plain until another mode has measured faster; then that mode, which
    gives plain's greedy tokens.  Every decode of a long enough reply is a measurement."""
    from core.decoding.mode_speeds import ModeSpeeds
    from core.policies import DecodeMode

    auto, greedy, saved = policy(enabled=False, decode_auto=True), SamplingParams(max_tokens=48), \
        smol_pair_engine.mode_speeds
    smol_pair_engine.mode_speeds = ModeSpeeds()
    try:
        first = run(smol_pair_engine, STORY, auto, greedy)
        assert first.timings.decode_mode == "plain" and first.timings.decode_auto
        assert first.timings.to_json()["decode_auto"] is True
        [(depth, _)] = smol_pair_engine.mode_speeds.samples[(DecodeMode.PLAIN, "free")]  # that decode, measured
        assert depth == first.timings.context_n
        smol_pair_engine.mode_speeds.observe(DecodeMode.SPECULATIVE, depth, 64, 1e-3)  # as if speculating were fast
        second = run(smol_pair_engine, STORY, auto, greedy)
        assert second.timings.decode_mode == "speculative" and second.tokens == first.tokens
        assert second.timings.speculative.n_drafted > 0
        # a request that names a mode gets it, measured or not
        explicit = run(smol_pair_engine, STORY, policy(enabled=False, decode_auto=True, specattn=True), greedy)
        assert explicit.timings.decode_mode == "specattn"
    finally:
        smol_pair_engine.mode_speeds = saved
