"""The real Qwen pair on a short prompt: a planted fact survives sparse prefill."""

from __future__ import annotations

import asyncio
import random

import pytest

from core.chat import ChatTemplate
from core.config import EngineConfig
from core.engine import Engine
from core.models import model_files
from core.policies import SamplingParams
from tests.support import forced, real_model, with_sampling

pytestmark = pytest.mark.real


@pytest.fixture(scope="module")
def qwen_pair():
    engine = Engine(EngineConfig(target=str(real_model(model_files.TARGET)),
                                 speculator=str(real_model(model_files.SPECULATOR)),
                                 n_ctx=2048, n_threads=2, calibrate_tokens=0))
    yield engine
    engine.close()


def needle_messages() -> list[dict]:
    filler = " ".join(f"Shelf {i} in the east hall stores spare parts for model {i * 7} pumps."
                      for i in range(30))
    fact = "The maintenance password for the west gate is TANGO-58."
    doc = filler[: len(filler) // 3] + " " + fact + " " + filler[len(filler) // 3:]
    return [{"role": "system", "content": "Answer from the document, briefly."},
            {"role": "user", "content": f"{doc}\n\nWhat is the maintenance password for the west gate?"}]


@pytest.mark.parametrize("mode", ["original", "compact"])
def test_planted_fact_survives_sparse_prefill(qwen_pair, mode):
    prompt = ChatTemplate(qwen_pair.target).render(needle_messages())
    # the document and its question are one user message: keep only the question dense
    params = forced(select_mode="chunk", keep_fraction=0.3,
                    position_mode=mode, lookahead=4, guard_user_tokens=48)
    r = qwen_pair.run(prompt, with_sampling(params, SamplingParams(max_tokens=24)))
    assert r.timings.specprefill == "active"
    assert r.timings.prompt_n < 0.6 * r.timings.context_n
    assert "TANGO-58" in r.text, r.text


def test_openai_client_tool_call_round_trip_on_the_real_pair():
    """The official client, unchanged but for base_url, gets a parsed tool call back."""
    import json

    import openai

    from tests.support import start_gateway

    gw = start_gateway(real_model(model_files.TARGET), real_model(model_files.SPECULATOR))
    try:
        client = openai.OpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0)
        tools = [{"type": "function", "function": {
            "name": "get_weather", "description": "Get the current weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
        question = [{"role": "user", "content": "What's the weather in Oslo right now?"}]
        reply = client.chat.completions.create(model="specgate", messages=question, tools=tools, max_tokens=64)
        assert reply.choices[0].finish_reason == "tool_calls"
        call = reply.choices[0].message.tool_calls[0]
        assert call.function.name == "get_weather"
        assert json.loads(call.function.arguments)["city"] == "Oslo"
        # the test gateway scores every prompt (min_tokens 0): with tools offered, the structural
        # guard keeps the tool definitions dense (on this short prompt, with the question, that
        # can be every token) and the call still parses
        assert reply.model_extra["timings"]["specprefill"] in ("active", "kept_all")
        stream = client.chat.completions.create(model="specgate", messages=question, tools=tools, max_tokens=64,
                                                stream=True)
        chunks = [c for c in stream if c.choices]
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == ""
        streamed = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
        assert streamed[0].function.name == "get_weather"
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        ws_call, kept = asyncio.run(ws_tool_turn(gw, question, tools))
        assert ws_call["function"]["name"] == "get_weather"
        assert kept == ws_call  # the history keeps the very call (and id) the client was sent
    finally:
        gw.stop()


async def ws_tool_turn(gw, question, tools):
    """A WebSocket turn that answers with a tool call: the call in the ``done`` event and the
    call the session's stored history holds."""
    import aiohttp
    import httpx

    from gateway import keys

    sid = httpx.post(gw.base + "/v1/sessions", json={}).json()["id"]
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{gw.base}/v1/sessions/{sid}/ws") as ws:
        await ws.send_json({"type": "turn", "messages": question, "tools": tools, "max_tokens": 64})
        while (event := await ws.receive_json(timeout=300))["type"] == "delta":
            assert not event["content"].lstrip().startswith(("<tool_call>", "{"))
    assert event["type"] == "done" and event["finish_reason"] == "tool_calls"
    session = gw.call(gw.app[keys.MANAGER].get("anonymous", sid))  # on the gateway's own loop
    return event["message"]["tool_calls"][0], session.messages[-1]["tool_calls"][0]


def test_agent_turn_with_a_long_tool_result_runs_active_and_the_next_call_parses():
    """The agent-shaped path end to end through the openai client: tools in the request, a
    long tool result after the assistant's call; SpecPrefill runs on it, and the model's next
    tool call is valid (an offered tool, arguments that satisfy its schema)."""
    import json

    import jsonschema
    import openai

    from bench.textgen import AGENT_TOOLS, filler
    from core.policies import PrefillPolicy
    from tests.support import start_gateway

    rng = random.Random(5)
    log = " ".join(filler(700, rng))
    half = len(log) // 2
    result = f"{log[:half]}\nSTATUS: service billing is DOWN; it must be restarted.\n{log[half:]}"
    call = {"id": "call_1", "type": "function", "function": {"name": "read_log", "arguments": '{"service": "billing"}'}}
    messages = [
        {"role": "system", "content": "You are an operations agent. Act with the tools."},
        {"role": "user", "content": "Check the billing log. If billing is down, restart it."},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": result},
    ]
    gw = start_gateway(real_model(model_files.TARGET), real_model(model_files.SPECULATOR),
                       prefill=PrefillPolicy(min_tokens=0, break_even=False, bridge=False))
    try:
        client = openai.OpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model="specgate", messages=messages, tools=AGENT_TOOLS,
                                               max_tokens=48, temperature=0,
                                               extra_headers={"X-SpecGate-Session": "agent-e2e"})
        t = reply.model_extra["timings"]
        assert t["specprefill"] == "active" and t["prompt_n"] < 0.7 * t["context_n"], t
        assert "tool definitions" in t["specprefill_reason"]
        (next_call,) = reply.choices[0].message.tool_calls
        schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in AGENT_TOOLS}
        assert next_call.function.name == "restart_service"
        jsonschema.validate(json.loads(next_call.function.arguments), schemas[next_call.function.name])
    finally:
        gw.stop()


def test_responses_chain_and_forced_output_on_the_real_pair():
    """The Responses API on the real pair: a function-call round trip where each follow-up
    sends only its new items and reports the earlier turns as cached; then forced calls (over
    a coding agent's 20 tools, and a named function the prompt does not ask for) and
    json_schema replies, every one of which must validate."""
    import json

    import jsonschema
    import openai

    from bench.constrained import ARMS, REPLY_SCHEMA, TOOLS
    from tests.support import start_gateway

    gw = start_gateway(real_model(model_files.TARGET), real_model(model_files.SPECULATOR))
    try:
        client = openai.OpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0)
        tools = [{"type": "function", "name": "get_weather", "description": "Get the current weather for a city",
                  "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
        r1 = client.responses.create(model="m", input="What's the weather in Oslo right now?", tools=tools,
                                     max_output_tokens=64)
        (call,) = [item for item in r1.output if item.type == "function_call"]
        assert call.name == "get_weather" and json.loads(call.arguments)["city"] == "Oslo"
        r2 = client.responses.create(model="m", previous_response_id=r1.id, tools=tools, max_output_tokens=48,
                                     input=[{"type": "function_call_output", "call_id": call.call_id,
                                             "output": "Oslo: 21 degrees and sunny"}])
        assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens
        r3 = client.responses.create(model="m", previous_response_id=r2.id, tools=tools, max_output_tokens=16,
                                     input="Thanks.")
        assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens
        chat = openai.OpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0).chat.completions
        params = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        for _ in range(2):  # specgate bench constrained runs 20 of each
            for arm in ("required_20_tools", "named_function"):
                reply = chat.create(model="m", max_tokens=96, **ARMS[arm])
                calls = reply.choices[0].message.tool_calls
                assert calls, arm
                for c in calls:
                    assert arm != "named_function" or c.function.name == "set_alarm"
                    jsonschema.validate(json.loads(c.function.arguments), params[c.function.name])
            reply = chat.create(model="m", max_tokens=160, **ARMS["json_schema"])
            jsonschema.validate(json.loads(reply.choices[0].message.content), REPLY_SCHEMA)
    finally:
        gw.stop()
