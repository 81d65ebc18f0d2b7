"""Structured output and forced tool calls through the clients that need them, unchanged:
``openai`` (``response_format``, every ``tool_choice``), LangChain's ``with_structured_output``
(both methods), instructor (``TOOLS``, ``JSON_SCHEMA``) and pydantic-ai (tool, native and
prompted output).  On the tiny models, whose free text is noise: whatever they write, the
grammar makes it parse and validate, which is exactly what these tests check.  The schemas
are bounded (enums, booleans, small integers) so that noise cannot run on forever."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from core.models import model_files
from tests.support import real_model, start_gateway


class Weather(BaseModel):
    city: Literal["Oslo", "Bergen"]
    sunny: bool
    level: int = Field(ge=0, le=9)


SCHEMA = Weather.model_json_schema()
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather for a city.",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "properties": {"city": {"enum": ["Oslo", "Bergen"]}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "set_alarm", "description": "Set an alarm.",
                                      "parameters": {"type": "object", "additionalProperties": False,
                                                     "properties": {"hour": {"type": "integer", "minimum": 0,
                                                                             "maximum": 23}},
                                                     "required": ["hour"]}}},
]
ASK = [{"role": "user", "content": "Tell me a joke about pumps."}]


@pytest.fixture(scope="module")
def gw(tiny_target, tiny_speculator):
    server = start_gateway(tiny_target, tiny_speculator)
    yield server
    server.stop()


def client(gw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0)


def args_of(call) -> dict:
    return json.loads(call.function.arguments)


def test_response_format_json_schema_and_json_object(gw):
    c = client(gw)
    r = c.chat.completions.create(model="m", messages=ASK, max_tokens=40, response_format={
        "type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    assert r.model_extra["timings"]["constraint"] == "json_schema"
    r = c.chat.completions.create(model="m", messages=ASK, max_tokens=40, response_format={"type": "json_object"},
                                  stop=["\n"])
    assert r.model_extra["timings"]["constraint"] == "json_object"
    if r.choices[0].finish_reason == "stop":  # an open-ended object may still be cut by max_tokens
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("choice, names", [
    ("required", {"get_weather", "set_alarm"}),
    ({"type": "function", "function": {"name": "set_alarm"}}, {"set_alarm"}),
])
def test_forced_tool_calls_always_parse_and_validate(gw, choice, names):
    r = client(gw).chat.completions.create(model="m", messages=ASK, max_tokens=48, tools=TOOLS, tool_choice=choice,
                                           parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls  # exactly one: parallel_tool_calls is false
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in names
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(args_of(call), schema)


def test_tool_choice_none_and_bad_constraints(gw):
    c = client(gw)
    r = c.chat.completions.create(model="m", messages=ASK, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert not r.choices[0].message.tool_calls and "constraint" not in r.model_extra["timings"]
    for extra, needle in [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "not among"),
        ({"tool_choice": "required"}, "offers no tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"x": {"type": "string", "format": "no-such-format"}}}}}},
         "no-such-format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ]:
        with pytest.raises(openai.BadRequestError) as err:
            c.chat.completions.create(model="m", messages=ASK, max_tokens=4, **extra)
        assert needle in str(err.value), extra


def test_forced_call_wins_over_response_format(gw):
    """``required`` with a ``response_format``: this reply is the call (the format is for the
    answer after the tool results), as documented."""
    r = client(gw).chat.completions.create(model="m", messages=ASK, max_tokens=48, tools=TOOLS[:1],
                                           tool_choice="required", response_format={"type": "json_object"})
    assert r.choices[0].message.tool_calls[0].function.name == "get_weather"


def test_langchain_with_structured_output_both_methods(gw):
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(base_url=gw.base + "/v1", api_key="unused", model="m", max_tokens=48, max_retries=0)
    for method in ("json_schema", "function_calling"):
        out = llm.with_structured_output(Weather, method=method).invoke("Weather in Oslo?")
        assert isinstance(out, Weather), method


def test_instructor_tools_and_json_schema_modes(gw):
    import instructor

    for mode in (instructor.Mode.TOOLS, instructor.Mode.JSON_SCHEMA):
        patched = instructor.from_openai(client(gw), mode=mode)
        out = patched.chat.completions.create(model="m", messages=ASK, max_tokens=48, response_model=Weather,
                                              max_retries=0)
        assert isinstance(out, Weather), mode


def test_pydantic_ai_tool_and_native_output(gw):
    from pydantic_ai import Agent, NativeOutput
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=gw.base + "/v1", api_key="unused"))
    for output in (Weather, NativeOutput(Weather)):
        agent = Agent(model, output_type=output, retries=0, model_settings={"max_tokens": 48})
        assert isinstance(agent.run_sync("Weather in Oslo?").output, Weather), output


@pytest.mark.real
def test_pydantic_ai_prompted_output_on_the_real_pair():
    """Prompted output sends only ``json_object`` (the schema is in the prompt): every reply
    the gateway gives is a whole JSON object.  Whether it fills the schema is the model's
    part; the 1.5B often echoes the schema instead, which pydantic-ai then rejects."""
    from pydantic_ai import Agent, PromptedOutput, capture_run_messages
    from pydantic_ai.messages import ModelResponse, TextPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    server = start_gateway(real_model(model_files.TARGET), real_model(model_files.SPECULATOR))
    try:
        model = OpenAIChatModel("m", provider=OpenAIProvider(base_url=server.base + "/v1", api_key="unused"))
        agent = Agent(model, output_type=PromptedOutput(Weather), retries=1, model_settings={"max_tokens": 160})
        with capture_run_messages() as messages:
            try:
                out = agent.run_sync("It is sunny in Oslo today, level 4.").output
            except Exception:  # the model's part: checked below through what it was sent
                out = None
        replies = [p.content for m in messages if isinstance(m, ModelResponse) for p in m.parts
                   if isinstance(p, TextPart)]
        assert replies and all(isinstance(json.loads(text), dict) for text in replies), replies
        assert out is None or isinstance(out, Weather)
    finally:
        server.stop()


def test_a_constrained_turn_speculates_under_its_grammar(gw):
    """Speculative decoding asked for beside a constraint runs, drafts held to the grammar
    (core.decoding.speculative), and the reply still validates."""
    r = client(gw).chat.completions.create(model="m", messages=ASK, max_tokens=40, extra_body={"speculative": True},
                                           response_format={"type": "json_schema", "json_schema": {
                                               "name": "weather", "schema": SCHEMA}})
    t = r.model_extra["timings"]
    assert t["decode_mode"] == "speculative" and t["constraint"] == "json_schema" and "constraint_fallback" not in t
    assert t["draft_n"] > 0
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
