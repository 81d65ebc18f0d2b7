"""The agents' wire protocols through their official clients, unchanged: the Anthropic
Messages API (``anthropic``), the OpenAI Responses API (``openai`` and ``openai-agents``),
on tiny models for the wire shape (SmolLM2 where the client needs a reply that ends by
itself), behind API keys, with Redis holding the records."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from core.models import model_files
from tests.support import real_model, start_gateway

KEYS = ("key-a", "key-b")
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
A_TOOLS = [{"name": "get_weather", "description": "Weather for a city.", "input_schema": WEATHER}]
R_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather for a city.", "parameters": WEATHER},
           {"type": "web_search"}]  # a hosted tool, as Codex sends: ignored, not refused
ROUND_TRIP = [  # a tool_use -> tool_result round trip, as the anthropic client sends it back
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                      {"type": "tool_use", "id": "toolu_01", "name": "get_weather",
                                       "input": {"city": "Oslo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01", "content": "21 degrees"}]},
]


@pytest.fixture(scope="module")
def gw(tiny_target, tiny_speculator, redis_server):
    server = start_gateway(tiny_target, tiny_speculator, redis_url=redis_server.url, api_keys=KEYS,
                           limits=_limits(max_sessions_per_key=4))
    yield server
    server.stop()


def _limits(**fields):
    from core.config import Limits
    return Limits(**fields)


def anthropic_client(gw, **auth):
    import anthropic
    return anthropic.Anthropic(base_url=gw.base, max_retries=0, **(auth or {"api_key": KEYS[0]}))


def openai_client(gw, key: str = KEYS[0]):
    import openai
    return openai.OpenAI(base_url=gw.base + "/v1", api_key=key, max_retries=0)


# -- Anthropic Messages ------------------------------------------------------------------
def test_anthropic_tool_round_trip_plain_and_streamed_with_count_tokens(gw):
    client = anthropic_client(gw)
    kwargs = {"model": "claude-test", "max_tokens": 6, "system": "Be terse.", "messages": ROUND_TRIP,
              "tools": A_TOOLS}
    msg = client.messages.create(**kwargs)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "claude-test"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 6
    assert msg.content and msg.content[0].type in ("text", "tool_use")
    counted = client.messages.count_tokens(model="claude-test", system="Be terse.", messages=ROUND_TRIP,
                                           tools=A_TOOLS)
    assert counted.input_tokens == msg.usage.input_tokens + msg.usage.cache_read_input_tokens  # the same render
    with client.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 6
    assert "".join(b.text for b in final.content if b.type == "text") == \
        "".join(b.text for b in msg.content if b.type == "text")  # greedy: the same reply both ways


def test_anthropic_key_by_either_header_and_errors_in_anthropic_shape(gw):
    bearer = anthropic_client(gw, auth_token=KEYS[0])  # Authorization: Bearer, as with ANTHROPIC_AUTH_TOKEN
    assert bearer.messages.create(model="m", max_tokens=2, messages=ROUND_TRIP[:1]).usage.output_tokens == 2
    r = httpx.post(gw.base + "/v1/messages", headers={"x-api-key": "wrong"},
                   json={"model": "m", "max_tokens": 2, "messages": ROUND_TRIP[:1]})
    assert r.status_code == 401 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "authentication_error"
    for body, needle in [
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
         "must be a text, tool_use"),
        ({"messages": ROUND_TRIP[:1], "tools": A_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
         "not among the offered tools"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "role"),
    ]:
        r = httpx.post(gw.base + "/v1/messages", headers={"x-api-key": KEYS[0]},
                       json={"model": "m", "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert needle in r.json()["error"]["message"]
    r = httpx.post(gw.base + "/v1/messages", headers={"x-api-key": KEYS[0]},
                   json={"model": "m", "messages": ROUND_TRIP[:1]})
    assert r.status_code == 400 and "max_tokens" in r.json()["error"]["message"]


def test_anthropic_session_header_reuses_the_conversation(gw):
    client = anthropic_client(gw, api_key=KEYS[0], default_headers={"X-SpecGate-Session": "anth-1"})
    history = list(ROUND_TRIP)
    first = client.messages.create(model="m", max_tokens=4, messages=history, tools=A_TOOLS)
    history += [{"role": "assistant", "content": [b.model_dump(include={"type", "text", "id", "name", "input"})
                                                  for b in first.content]},
                {"role": "user", "content": "And Bergen?"}]
    second = client.messages.create(model="m", max_tokens=4, messages=history, tools=A_TOOLS)
    assert second.usage.cache_read_input_tokens >= first.usage.input_tokens


# -- OpenAI Responses --------------------------------------------------------------------
def test_responses_chain_prefills_only_the_new_items(gw):
    client = openai_client(gw)
    r1 = client.responses.create(model="m", instructions="Be terse.", input="Weather in Oslo?", tools=R_TOOLS,
                                 max_output_tokens=6)
    # (r1 may reuse an earlier test's conversation: the same key sent the same prompt)
    assert r1.status == "incomplete" and r1.usage.input_tokens_details.cached_tokens < r1.usage.input_tokens
    r2 = client.responses.create(model="m", instructions="Be terse.", previous_response_id=r1.id, tools=R_TOOLS,
                                 max_output_tokens=6, input=[
                                     {"type": "function_call", "call_id": "call_1", "name": "get_weather",
                                      "arguments": '{"city": "Oslo"}'},
                                     {"type": "function_call_output", "call_id": "call_1", "output": "21"}])
    assert r2.usage.input_tokens_details.cached_tokens >= r1.usage.input_tokens  # turn 1 was not prefilled again
    kinds = []
    with client.responses.stream(model="m", instructions="Be terse.", previous_response_id=r2.id, tools=R_TOOLS,
                                 input="And Bergen?", max_output_tokens=6) as stream:
        kinds = [event.type for event in stream]
        r3 = stream.get_final_response()
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert "response.output_text.delta" in kinds or "response.function_call_arguments.done" in kinds
    assert r3.usage.input_tokens_details.cached_tokens >= r2.usage.input_tokens
    assert client.responses.retrieve(r2.id).output == r2.output


def test_responses_are_per_key_and_gone_once_deleted(gw):
    import openai

    mine, theirs = openai_client(gw), openai_client(gw, KEYS[1])
    r1 = mine.responses.create(model="m", input="Hello.", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.retrieve(r1.id)
    with pytest.raises(openai.NotFoundError):
        theirs.responses.create(model="m", previous_response_id=r1.id, input="x", max_output_tokens=2)
    mine.responses.delete(r1.id)
    with pytest.raises(openai.NotFoundError):
        mine.responses.create(model="m", previous_response_id=r1.id, input="x", max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        mine.responses.retrieve("resp_0123456789abcdef0123_deadbeef")


def test_responses_bad_input_gets_400(gw):
    cases = [
        ({"input": [{"type": "message", "role": "user", "content": [{"type": "input_hologram", "data": "x"}]}]},
         "not supported"),
        ({"input": [{"type": "computer_call"}]}, "not supported"),
        ({"input": "x", "tools": R_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
         "not among the offered tools"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "call_id"),
        ({}, "'input' is required"),
    ]
    for body, needle in cases:
        r = httpx.post(gw.base + "/v1/responses", headers={"Authorization": f"Bearer {KEYS[0]}"},
                       json={"model": "m", **body})
        assert r.status_code == 400 and needle in r.json()["error"]["message"], (body, r.text)


def test_stored_responses_give_way_at_the_key_cap(gw):
    """The key may hold 4 sessions: a flood of stored responses never gets a 429; the oldest
    server-made conversations are dropped (and their ids are then not found)."""
    import openai

    client = openai_client(gw, KEYS[1])
    ids = [client.responses.create(model="m", input=f"Note {i}.", max_output_tokens=1).id for i in range(7)]
    assert client.responses.retrieve(ids[-1]).id == ids[-1]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    r = httpx.get(gw.base + "/v1/sessions/anything", headers={"Authorization": f"Bearer {KEYS[1]}"})
    assert r.status_code == 404


def test_openai_agents_default_path_with_a_function_tool(small_model, redis_server):
    """The Agents SDK on its default model (the Responses API), a function tool offered, on
    SmolLM2 (a model whose replies end by themselves, as the SDK requires)."""
    import openai
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        return f"{city}: 21 degrees"

    gw = start_gateway(real_model(model_files.SMALL), real_model(model_files.SMALL), redis_url=redis_server.url)
    try:
        client = openai.AsyncOpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0)
        agent = Agent(name="a", instructions="Answer in one short sentence.", tools=[get_weather],
                      model=OpenAIResponsesModel("specgate", client), model_settings=ModelSettings(max_tokens=96))
        result = asyncio.run(Runner.run(agent, "Say hello.", max_turns=3))
        assert isinstance(result.final_output, str) and result.final_output
        assert result.raw_responses and result.raw_responses[-1].usage.input_tokens > 0
    finally:
        gw.stop()
