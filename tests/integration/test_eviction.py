"""Sessions past the window (issue 54) on a real engine: a conversation several windows long
keeps going by scored eviction (core.kv.eviction, core.kv.packing, core.kv.window_fit), each
turn reuses the packed cells of the last, and a packed cell's K is rotated to its new place."""

from __future__ import annotations

import random

import numpy as np
import pytest

from core.chat import ChatTemplate
from core.engine import Engine
from core.errors import PromptTooLong
from core.kv import cells
from core.kv.eviction import protected
from core.kv.packing import pack
from core.kv.positions import SessionKV, TokenCells
from core.llama import seq_cells
from core.policies import SamplingParams
from core.prompt import Prompt
from evals.agent_files import ToolResult, python_module
from tests.support import engine_config, forced, with_sampling

WINDOW = 2048
SPARSE = with_sampling(forced(mass=0.6), SamplingParams(max_tokens=4))


@pytest.fixture(scope="module")
def narrow(tiny_target, tiny_speculator):
    engine = Engine(engine_config(tiny_target, tiny_speculator, n_ctx=WINDOW, slots=2, recent_tokens=128))
    yield engine
    engine.close()


def read_turn(i: int) -> list[dict]:
    """An agent's turn: a question, a Read call, the file it returns (~250 tokens)."""
    module = next(m for seed in range(100 * i, 100 * i + 20) if (m := module_or_none(seed, f"src/m{i}.py")))
    call = {"id": f"c{i}", "type": "function", "function": {"name": "Read",
                                                           "arguments": f'{{"file_path": "src/m{i}.py"}}'}}
    return [{"role": "user", "content": f"What does src/m{i}.py define?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"c{i}", "content": module.content}]


def module_or_none(seed: int, path: str) -> ToolResult | None:
    try:
        return python_module(random.Random(seed), path, target_chars=400)
    except IndexError:  # a module too short to hold a function to ask about
        return None


def check_cells(engine: Engine, kv: SessionKV, prompt: Prompt, before: list[int], slot: int = 0) -> None:
    """The records agree with the cells: the target's cells in logical order inside the window
    (packed, then the later turns' own gaps), every instruction, user message and tool call
    held ``before`` the turn still held, and the scorer's cells as its record says, laid out
    in position order with no gap (its attention columns map to them)."""
    if kv.target.packed:
        held = np.asarray(kv.target.kv_pos)
        held = held[held >= 0]
        assert (np.diff(held) > 0).all() and held[-1] < engine.kv_window
        assert engine.target_ctx.seq(slot).pos_max() == kv.target.next_pos - 1
        n = min(len(before), len(prompt))
        was = (np.asarray(before[:n]) >= 0) & protected(len(prompt), prompt.spans, 0)[:n]
        assert (np.asarray(kv.target.kv_pos[:n])[was] >= 0).all(), "a user message or tool call was evicted"
    spec = np.asarray(kv.speculator.kv_pos)
    if spec.size and kv.target.packed:
        scorer = engine.speculator_ctx.seq(slot)
        layout = seq_cells.parse(scorer.save(), scorer.id).positions
        assert layout.tolist() == list(range(layout.size)) == spec[spec >= 0].tolist()


def test_a_conversation_three_windows_long_keeps_going_and_reuses_its_cells(narrow):
    chat, kv = ChatTemplate(narrow.target), SessionKV()
    narrow.slot_cells.load(None)
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent. Answer from the files."}]
    evicted, after_evicting, last_n = 0, [], 0
    for i in range(20):
        messages += read_turn(i)
        prompt = chat.render_chat(messages, ())
        before = list(kv.target.kv_pos)
        res = narrow.run(prompt, SPARSE, kv=kv)
        t = res.timings
        assert t.physical_n + len(res.tokens) <= narrow.kv_window
        assert kv.target.tokens[: len(prompt)] == list(prompt.tokens)
        check_cells(narrow, kv, prompt, before)
        if evicted:
            after_evicting.append((t, last_n))
        last_n = len(prompt)
        evicted += t.evicted_n
        messages.append({"role": "assistant", "content": res.text or "ok"})
        if len(prompt) > 3 * WINDOW:
            break
    assert len(prompt) > 3 * WINDOW and evicted > 0
    # each turn past the window starts from the last one's cells: it prefills its own tokens
    assert all(t.cache_n >= last - 1 and t.speculator_mirrored_n == 0 for t, last in after_evicting)
    assert sum(1 for t, _ in after_evicting if t.evicted_n) < len(after_evicting)  # not on every turn


def test_a_prompt_past_the_window_with_no_cache_is_served(narrow):
    chat = ChatTemplate(narrow.target)
    messages: list[dict] = [{"role": "system", "content": "You are a coding agent."}]
    for i in range(14):
        messages += read_turn(i) + [{"role": "assistant", "content": "Read it."}]
    messages += read_turn(14)
    prompt = chat.render_chat(messages, ())
    assert len(prompt) > 2 * WINDOW
    narrow.slot_cells.load(None, 1)
    res = narrow.run(prompt, SPARSE, slot=1)
    assert res.timings.evicted_n > 0 and res.timings.physical_n < narrow.kv_window
    assert res.kept.size == res.timings.prompt_n < narrow.kv_window
    assert res.timings.prompt_n + res.timings.evicted_n <= len(prompt)
    system = prompt.spans[0]
    assert np.isin(np.arange(system.start, system.end), res.kept).all()


def test_what_must_stay_past_the_window_is_checked_before_the_turn(narrow):
    with pytest.raises(PromptTooLong, match="must keep"):
        narrow.check_turn(Prompt(tuple([100] * (WINDOW + 10))), SPARSE)  # one raw message: all of it stays
    too_long = Prompt(tuple([100] * (narrow.config.context_limit + 1)))
    with pytest.raises(PromptTooLong, match=f"{narrow.config.context_limit}$"):
        narrow.check_turn(too_long, SPARSE)


def test_packing_rotates_each_moved_key_to_its_new_position(narrow):
    """Dropping the first cells and moving the rest down by the same distance keeps every
    relative distance, so the next token's logits are those of the cells left where they
    were, to f16 rounding: the K-shift was applied.  (Labels moved without their K rotated
    gave a mean difference of 1.46 and another argmax on this model; the K-shift 0.057.)"""
    chat = ChatTemplate(narrow.target)
    tokens = list(chat.render([{"role": "user", "content": " ".join(f"item {k} costs {k * 7} coins." for k in
                                                                     range(40))}]).tokens)
    seq, drop = narrow.target_ctx.seq(0), 48
    logits = []
    for packed in (True, False):
        cells.reset(seq)
        seq.decode(tokens[:-1], 0, logits_last=False)
        kv = TokenCells(tokens[:-1], list(range(len(tokens) - 1)))
        if packed:
            keep = np.ones(len(tokens) - 1, dtype=bool)
            keep[:drop] = False
            pack(seq, kv, keep)
            assert kv.next_pos == len(tokens) - 1 - drop and seq.pos_max() == kv.next_pos - 1
            seq.decode(tokens[-1:], kv.next_pos)
        else:
            seq.remove_cells(0, drop)
            seq.decode(tokens[-1:], len(tokens) - 1)
        logits.append(np.array(seq.logits(), dtype=np.float64))
    cells.reset(seq)
    assert np.abs(logits[0] - logits[1]).mean() < 0.3
    assert int(np.argmax(logits[0])) == int(np.argmax(logits[1]))


def test_an_agent_resending_its_history_past_the_window_over_http(tiny_target, tiny_speculator, redis_server):
    """Anthropic Messages, no session named, the whole history resent each turn with tools, as
    Claude Code sends it: past the window every request is served, each continuing the
    conversation its tokens match (logical tokens), and /v1/models reports the limit."""
    import httpx

    from tests.support import start_gateway

    server = start_gateway(tiny_target, tiny_speculator, redis_url=redis_server.url,
                           engine={"n_ctx": WINDOW, "slots": 2})
    tools = [{"name": "Read", "description": "Read a file", "input_schema": {
        "type": "object", "properties": {"file_path": {"type": "string"}}, "required": ["file_path"]}}]
    messages: list[dict] = []
    try:
        model = httpx.get(server.base + "/v1/models").json()["data"][0]
        assert model["context_window"] == 4 * WINDOW and model["kv_window"] == WINDOW
        seen = []
        for i in range(16):
            turn = read_turn(i)
            messages += [{"role": "user", "content": turn[0]["content"]},
                         {"role": "assistant", "content": [{"type": "tool_use", "id": f"toolu_{i}", "name": "Read",
                                                            "input": {"file_path": f"src/m{i}.py"}}]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": f"toolu_{i}",
                                                       "content": turn[2]["content"]}]}]
            r = httpx.post(server.base + "/v1/messages", timeout=120, json={
                "model": "m", "max_tokens": 4, "system": "You are a coding agent.", "tools": tools,
                "messages": messages})
            assert r.status_code == 200, r.text[:300]
            body = r.json()
            seen.append((body["usage"], body["timings"]))
            messages.append({"role": "assistant", "content": [b for b in body["content"] if b["type"] == "text"]
                             or [{"type": "text", "text": "ok"}]})
            if body["timings"]["context_n"] > 2 * WINDOW:
                break
    finally:
        server.stop()
    usage, t = seen[-1]
    assert t["context_n"] > 2 * WINDOW and t.get("physical_n", t["context_n"]) < WINDOW
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == t["context_n"]  # logical tokens
    assert sum(s[1].get("evicted_n", 0) for s in seen) > 0
    assert usage["cache_read_input_tokens"] >= seen[-2][1]["context_n"] - 64  # the last turn's cells reused
