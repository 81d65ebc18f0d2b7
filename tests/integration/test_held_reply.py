"""A reply that called tools is rewritten in idle time in the form the client resends it
(sessions.kv.held_reply): the next turn, which resends the call with its result, reuses the
reply and the results' opening instead of prefilling them again.  Tiny pair, a real
gateway, the history resent with no session id, as agents send it."""

from __future__ import annotations

import httpx

from core.chat import ChatTemplate
from core.llama.model import Model
from gateway import keys
from tests.support import start_gateway, until

TOOLS = [{"type": "function", "function": {"name": "read_file", "description": "Read a file.", "parameters": {
    "type": "object", "properties": {"path": {"enum": ["notes.txt", "todo.txt"]}}, "required": ["path"],
    "additionalProperties": False}}}]  # bounded: the tiny model's noise cannot run on past max_tokens
ASK = [{"role": "system", "content": "You read files for an operator."},
       {"role": "user", "content": "What does notes.txt say? Read it."}]
FORCED = {"type": "function", "function": {"name": "read_file"}}


def chat(base: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(base + "/v1/chat/completions", timeout=120,
                   json={"messages": messages, "tools": TOOLS, "max_tokens": 32, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_held_tool_call_is_rewritten_and_the_next_turn_reuses_it_through_the_results_opening(
        tiny_target, tiny_speculator):
    gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, catch_up_tokens=64)
    residency = gw.app[keys.MANAGER].residency
    model = Model(str(tiny_target))
    try:
        first = chat(gw.base, ASK, tool_choice=FORCED, parallel_tool_calls=False, max_tokens=48)
        reply = first["choices"][0]["message"]
        assert reply["tool_calls"][0]["function"]["name"] == "read_file"
        prompt_n = first["usage"]["prompt_tokens"]
        form = ChatTemplate(model).resend_form([*ASK, reply], TOOLS)
        assert until(lambda: residency.rewritten > 0, 30)  # the sampled reply was not in the template's form
        result = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "Pump 3 is due."}
        second = chat(gw.base, [*ASK, reply, result])
        reused = second["usage"]["prompt_tokens_details"]["cached_tokens"]
        # through the call and the results' opening: what the rewrite prefilled is not prefilled again
        assert reused == len(form) > prompt_n + residency.rewritten - 1
        assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"] - len(form)
    finally:
        gw.stop()
        model.close()


def test_a_reply_without_tool_calls_is_left_as_it_was_sampled(tiny_target, tiny_speculator):
    gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, catch_up_tokens=64)
    manager = gw.app[keys.MANAGER]
    try:
        chat(gw.base, ASK, tool_choice="none")
        assert until(lambda: manager.worker.stats.idle_chunks > 0, 30)
        assert manager.residency.rewritten == 0
    finally:
        gw.stop()
