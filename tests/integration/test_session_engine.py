"""Multi-turn engine behaviour: delta prefill, rollback on edits, KV save/restore."""

from __future__ import annotations

import contextlib

import numpy as np

from core.chat import ChatTemplate
from core.kv.positions import SessionKV, cached_indices
from core.policies import SamplingParams
from core.prompt import Prompt
from core.results import Timings
from core.spans import common_prefix
from core.specprefill.cost_model import PrefillCost
from core.steps import drive
from tests.support import forced, with_sampling

GREEDY = SamplingParams(max_tokens=6)
KEEP_ALL = forced(mass=1.0)
SPARSE = forced(mass=0.5, guard_user_tokens=16)  # sparsify the question too


def doc(i: int, n: int = 12) -> str:
    return " ".join(f"Record {i}.{k}: sensor {k % 5} read {k * i + 3} units." for k in range(n))


def conversation(turns: int, replies: list[str]) -> list[list[dict]]:
    msgs = [{"role": "system", "content": "You summarize sensor logs."}]
    out = []
    for i in range(turns):
        msgs = msgs + [{"role": "user", "content": doc(i) + f" Which sensor read most in batch {i}?"}]
        out.append(list(msgs))
        if i < len(replies):
            msgs = msgs + [{"role": "assistant", "content": replies[i]}]
    return out


def test_second_turn_prefills_only_the_delta(tiny_engine):
    with speculator_costs(tiny_engine, TOKEN_BOUND):  # a mirror never repays: the delta path
        second_turn_prefills_only_the_delta(tiny_engine)


def second_turn_prefills_only_the_delta(tiny_engine):
    chat = ChatTemplate(tiny_engine.target)
    kv = SessionKV()
    tiny_engine.slot_cells.load(None)
    t1 = chat.render(conversation(1, [])[0])
    r1 = tiny_engine.run(t1, with_sampling(SPARSE, GREEDY), kv=kv)
    assert r1.timings.speculator_cache_n == 0 and r1.timings.speculator_prefill_n == len(t1)
    msgs2 = conversation(2, [r1.text])[1]
    t2 = chat.render(msgs2)
    # the reply is not prefilled into the speculator on the reply's path: it is deferred
    assert kv.speculator.tokens == list(t1.tokens)
    assert r1.timings.speculator_deferred_n == len(kv.target.tokens) - len(t1) > 0
    reused = common_prefix(kv.speculator.tokens, t2.tokens)
    assert reused == len(t1)
    r2 = tiny_engine.run(t2, with_sampling(SPARSE, GREEDY), kv=kv)
    assert r2.timings.speculator_cache_n == reused and r2.timings.speculator_mirrored_n == 0
    assert r2.timings.speculator_prefill_n == len(t2) - reused  # the deferred reply, caught up now
    assert r2.timings.speculator_deferred_n == len(kv.target.tokens) - len(t2)
    assert r2.timings.cache_n > 0 and r2.timings.specprefill == "active"
    assert r2.timings.prompt_n < len(t2) - r2.timings.cache_n
    assert kv.target.tokens[: len(t2)] == list(t2.tokens)


def test_keep_all_session_matches_fresh_requests(smol_engine):
    tiny_engine = smol_engine
    chat = ChatTemplate(tiny_engine.target)
    kv = SessionKV()
    tiny_engine.slot_cells.load(None)
    replies: list[str] = []
    session_out, fresh_out = [], []
    for i in range(3):
        prompt = chat.render(conversation(i + 1, replies)[i])
        r = tiny_engine.run(prompt, with_sampling(KEEP_ALL, GREEDY), kv=kv)
        if i:
            assert r.timings.cache_n > 0
        session_out.append(r.tokens)
        replies.append(r.text)
    for i in range(3):
        prompt = chat.render(conversation(i + 1, replies)[i])
        fresh_out.append(tiny_engine.run(prompt, with_sampling(KEEP_ALL, GREEDY)).tokens)
    assert session_out == fresh_out


def test_edited_history_rolls_back_to_common_prefix(smol_engine):
    tiny_engine = smol_engine
    chat = ChatTemplate(tiny_engine.target)
    kv = SessionKV()
    tiny_engine.slot_cells.load(None)
    first = conversation(1, [])[0]
    tiny_engine.run(chat.render(first), with_sampling(KEEP_ALL, GREEDY), kv=kv)
    edited = [first[0], {"role": "user", "content": doc(9) + " Which sensor read least?"}]
    prompt = chat.render(edited)
    r = tiny_engine.run(prompt, with_sampling(KEEP_ALL, GREEDY), kv=kv)
    system_len = len(chat.render([first[0]]).tokens) - 3  # minus the generation header
    assert system_len <= r.timings.cache_n < len(prompt) // 2
    assert r.timings.speculator_cache_n == r.timings.cache_n
    fresh = tiny_engine.run(prompt, with_sampling(KEEP_ALL, GREEDY))
    assert r.tokens == fresh.tokens


def test_saved_kv_restores_the_session(smol_engine):
    tiny_engine = smol_engine
    chat = ChatTemplate(tiny_engine.target)
    kv_a, kv_b = SessionKV(), SessionKV()
    conv = conversation(2, ["Sensor 4."])
    tiny_engine.slot_cells.load(None)
    tiny_engine.run(chat.render(conv[0]), with_sampling(KEEP_ALL, GREEDY), kv=kv_a)
    saved = tiny_engine.slot_cells.save()
    assert len(saved[0]) > 0 and len(saved[1]) > 0
    tiny_engine.slot_cells.load(None)
    other = chat.render([{"role": "user", "content": "Other session."}])
    tiny_engine.run(other, with_sampling(KEEP_ALL, GREEDY), kv=kv_b)
    tiny_engine.slot_cells.load(saved)
    prompt = chat.render(conv[1])
    resumed = tiny_engine.run(prompt, with_sampling(KEEP_ALL, GREEDY), kv=kv_a)
    assert resumed.timings.cache_n > 0
    assert resumed.tokens == tiny_engine.run(prompt, with_sampling(KEEP_ALL, GREEDY)).tokens


ATTENTION_BOUND = (1e-4, 1e-4, 0.0)  # re-prefilling the target's cells always repays
TOKEN_BOUND = (1e-4, 0.0, 0.0)  # fewer cells attended saves nothing: a mirror never repays


@contextlib.contextmanager
def speculator_costs(engine, coef: tuple[float, float, float]):
    """Pin the speculator's measured costs: the mirror-or-not choice then does not depend
    on what earlier tests measured on this machine."""
    saved = engine.costs.speculator
    engine.costs.speculator = PrefillCost(coef=np.array(coef))
    try:
        yield
    finally:
        engine.costs.speculator = saved


def sparse_first_turn(engine) -> tuple[SessionKV, Prompt]:
    """A fresh session after one sparse turn, and the next turn's prompt."""
    chat, kv = ChatTemplate(engine.target), SessionKV()
    engine.slot_cells.load(None)
    r1 = engine.run(chat.render(conversation(1, [])[0]), with_sampling(SPARSE, GREEDY), kv=kv)
    assert r1.timings.specprefill == "active" and r1.timings.speculator_mirrored_n == 0
    assert cached_indices(kv.target) != list(range(len(kv.target.tokens)))  # the target dropped part of it
    return kv, chat.render(conversation(2, [r1.text])[1])


def test_speculator_mirrors_the_sparse_target_before_scoring_a_long_delta(tiny_engine):
    kv, t2 = sparse_first_turn(tiny_engine)
    held = cached_indices(kv.target)
    shared = common_prefix(kv.target.tokens, t2.tokens)
    with speculator_costs(tiny_engine, ATTENTION_BOUND):
        r2 = tiny_engine.run(t2, with_sampling(SPARSE, GREEDY), kv=kv)
    assert r2.timings.specprefill == "active"
    history = [i for i in held if i < shared]
    # the speculator re-prefilled exactly the target's cells of the shared history, then the rest
    assert r2.timings.speculator_mirrored_n == len(history)
    assert cached_indices(kv.speculator)[: len(history)] == history
    assert cached_indices(kv.speculator)[len(history):] == list(range(shared, len(t2)))
    assert kv.speculator.tokens == list(t2.tokens)
    assert tiny_engine.speculator_ctx.seq(0).pos_max() == len(t2) - 1  # positions stay logical
    assert r2.timings.speculator_prefill_n == len(history) + len(t2) - shared


def test_captured_columns_map_to_logical_tokens_on_a_mirrored_speculator(tiny_engine):
    kv, prompt = sparse_first_turn(tiny_engine)
    tokens = prompt.tokens
    with speculator_costs(tiny_engine, ATTENTION_BOUND):
        steps = drive(tiny_engine.spec.capture_steps(kv, tokens, 2, Timings()))
    first = steps[0]
    assert first.shape[2] == len(tokens)
    dropped = [i for i, p in enumerate(kv.speculator.kv_pos) if p < 0]
    assert dropped  # mirrored: the speculator holds no cell for these
    assert not first[:, :, dropped].any()
    held = cached_indices(kv.speculator)
    assert (first[:, :, held].sum(axis=2) > 0.999).all()  # each head's softmax, all on held tokens
    assert (first[:, :, held[-1]] > 0).all()
