"""The step loop on a real model: several turns batched give each the tokens it gets alone.

SmolLM2-135M is target and speculator here: coherent greedy outputs, without
the near-ties of the truncated test models (batched and unbatched decodes sum
in different orders, see ../shared/DESIGN.md on logits across batch splits).
"""

from __future__ import annotations

import concurrent.futures

import pytest

from core.engine import Engine
from core.errors import TurnCancelled
from core.policies import SamplingParams
from core.runtime.step_loop import Job, StepLoop
from core.steps import Wait
from tests.support import engine_config, policy, with_sampling

QUESTIONS = ("Name three primary colours.", "What is the capital of France?",
             "Write one sentence about the sea.", "Count from one to five.")
PARAMS = with_sampling(policy(enabled=False), SamplingParams(max_tokens=16))


@pytest.fixture(scope="module")
def slots_engine(small_model):
    engine = Engine(engine_config(small_model, small_model, slots=4, n_ctx=1024, calibrate_tokens=0))
    yield engine
    engine.close()


def prompt(engine: Engine, text: str, repeat: int = 1):
    return engine.chat.render([{"role": "user", "content": " ".join([text] * repeat)}])


def run_together(engine: Engine, loop: StepLoop, turns) -> list[concurrent.futures.Future]:
    futures = []
    for turn, abort in turns:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()
        loop.add(Job(turn, fut, abort))
        futures.append(fut)
    while loop.busy:
        loop.step()
    return futures


def test_batched_turns_get_their_solo_tokens(slots_engine):
    e = slots_engine
    prompts = [prompt(e, q) for q in QUESTIONS]
    alone = [e.run(p, PARAMS, slot=0).tokens for p in prompts]
    loop = StepLoop(step_tokens=16)
    futures = run_together(e, loop, [(e.turn(p, PARAMS, slot=i), None) for i, p in enumerate(prompts)])
    together = [f.result().tokens for f in futures]
    assert together == alone
    assert max(loop.stats.rows_hist) == 4  # all four decoded in one batch
    assert loop.stats.batch_rows > loop.stats.batches  # more than one turn per batch on average


def test_a_long_prefill_shares_steps_with_decoding_turns(slots_engine):
    e = slots_engine
    short = [prompt(e, q) for q in QUESTIONS[:2]]
    long_ = prompt(e, "The archive lists crates, shelves and lamps in every aisle.", repeat=30)
    solo = e.run(long_, PARAMS, slot=0).tokens
    loop = StepLoop(step_tokens=32)
    futures = run_together(e, loop, [(e.turn(short[0], PARAMS, slot=0), None),
                                     (e.turn(short[1], PARAMS, slot=1), None),
                                     (e.turn(long_, PARAMS, slot=2), None)])
    assert futures[2].result().tokens == solo
    assert all(f.result().finish_reason in ("stop", "length") for f in futures)
    assert loop.stats.chunk_stalls > 0  # decoding turns got tokens in steps that carried a chunk


def test_a_budgeted_chunk_keeps_a_long_prefill_moving_in_small_steps_beside_decoding_turns(slots_engine):
    """With a prefill share, chunks beside decoding turns are sized by the engine's measured
    costs: far below the cap on a CPU (a prefill token costs a good part of a decode step),
    yet the long prompt advances while the others decode, and every turn gets its solo tokens."""
    e = slots_engine
    e.calibrate(128)
    short = [prompt(e, q) for q in QUESTIONS[:3]]
    long_ = prompt(e, "The archive lists crates, shelves and lamps in every aisle.", repeat=30)
    solo = [e.run(p, PARAMS, slot=0).tokens for p in (*short, long_)]
    loop = StepLoop(step_tokens=256, prefill_share=0.5)
    loop.budget.cost = e.prefill_seconds
    futures = run_together(e, loop, [(e.turn(p, PARAMS, slot=i), None) for i, p in enumerate((*short, long_))])
    assert [f.result().tokens for f in futures] == solo
    assert loop.stats.chunk_stalls > 0 and loop.budget.base_s is not None
    assert loop.stats.stall_tokens / loop.stats.chunk_stalls < 64  # a fixed chunk would be the cap, 256


def test_chunks_alternate_shortest_first_and_first_come_so_a_long_prompt_keeps_moving(slots_engine):
    e = slots_engine
    long_ = prompt(e, "The archive lists crates, shelves and lamps in every aisle.", repeat=60)
    shorts = [prompt(e, q) for q in QUESTIONS[:2]]
    loop = StepLoop(step_tokens=0)  # decode first: with no turn streaming every chunk is a full batch
    jobs = [Job(e.turn(p, PARAMS, slot=i), concurrent.futures.Future()) for i, p in enumerate((long_, *shorts))]
    for job in jobs:
        job.future.set_running_or_notify_cancel()
        loop.add(job)
    loop.step()
    loop.step()
    assert jobs[0].last_chunk > 0 and jobs[0].remaining > 0  # the long prompt got a chunk in the first two
    assert sum(j.last_chunk > 0 for j in jobs[1:]) == 1  # steps, and so did the shortest prompt
    while loop.busy:
        loop.step()
    assert [j.future.result().tokens for j in jobs] == [e.run(p, PARAMS, slot=3).tokens for p in (long_, *shorts)]


def test_an_aborted_turn_ends_before_its_next_chunk_and_the_others_finish(slots_engine):
    e = slots_engine
    long_ = prompt(e, "The archive lists crates, shelves and lamps in every aisle.", repeat=60)
    assert 512 < len(long_) < 1000  # more than one chunk even at full batch size
    calls = {"n": 0}

    def abort() -> bool:
        calls["n"] += 1
        return calls["n"] > 1  # one chunk, then the client is gone

    loop = StepLoop(step_tokens=32)
    futures = run_together(e, loop, [(e.turn(long_, PARAMS, slot=0), abort),
                                     (e.turn(prompt(e, QUESTIONS[1]), PARAMS, slot=1), None)])
    with pytest.raises(TurnCancelled):
        futures[0].result()
    assert futures[1].result().tokens == e.run(prompt(e, QUESTIONS[1]), PARAMS, slot=1).tokens
    assert not loop.busy


def test_decode_first_holds_prefill_while_turns_decode(slots_engine):
    e = slots_engine
    long_ = prompt(e, "The archive lists crates, shelves and lamps in every aisle.", repeat=30)
    short = prompt(e, QUESTIONS[0])
    loop = StepLoop(step_tokens=0)
    futures = run_together(e, loop, [(e.turn(short, PARAMS, slot=0), None), (e.turn(long_, PARAMS, slot=1), None)])
    assert [f.result().tokens for f in futures] == [e.run(p, PARAMS, slot=2).tokens for p in (short, long_)]
    assert loop.stats.chunk_stalls == 0  # no step carried both a decoding turn and a prefill chunk


def test_a_waiting_turn_resumes_when_ready_and_never_holds_prefill_back(slots_engine):
    """Decode first (step_tokens=0): a turn that waits is not streaming, so the turn it
    waits for still gets its prefill; it resumes after, and gets its solo tokens."""
    e = slots_engine
    first, second = prompt(e, QUESTIONS[0]), prompt(e, QUESTIONS[1])
    done: list[str] = []

    def builder():
        result = yield from e.turn(first, PARAMS, slot=0)
        done.append("builder")
        return result

    def waiter():
        yield Wait(lambda: "builder" in done)
        done.append("waiter")
        return (yield from e.turn(second, PARAMS, slot=1))

    loop = StepLoop(step_tokens=0)
    futures = run_together(e, loop, [(waiter(), None), (builder(), None)])
    assert done == ["builder", "waiter"]
    assert [f.result().tokens for f in futures] == [e.run(p, PARAMS, slot=2).tokens for p in (second, first)]


def test_a_waiting_turn_whose_client_left_is_cancelled(slots_engine):
    e = slots_engine

    def waiter():
        yield Wait(lambda: False)
        raise AssertionError("resumed although never ready")

    loop = StepLoop(step_tokens=0)
    gone = {"now": False}
    other = prompt(e, QUESTIONS[2])

    def turn_then_leave():
        result = yield from e.turn(other, PARAMS, slot=0)
        gone["now"] = True
        return result

    futures = run_together(e, loop, [(waiter(), lambda: gone["now"]), (turn_then_leave(), None)])
    with pytest.raises(TurnCancelled):
        futures[0].result()
    assert futures[1].result().tokens == e.run(other, PARAMS, slot=1).tokens
    assert not loop.busy
