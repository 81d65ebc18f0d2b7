"""The wire format without models: request parsing, tool calls, the one turn result,
the streaming hold-back, and the timings serializer."""

from __future__ import annotations

import json

import pytest

from core.chat import for_template
from core.errors import ConfigError, InvalidRequest
from core.policies import TurnParams
from core.results import Result, SpeculativeStats, Timings
from gateway import chat_request, tool_calls
from gateway.wire.openai_chat import objects as openai_chat_objects

TOOLS = ({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_tool_call_parsing():
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = tool_calls.parse(text)
    assert content == "Let me check."
    assert calls[0]["function"]["name"] == "get_weather"
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert tool_calls.parse("plain answer") == ("plain answer", [])
    assert tool_calls.parse("<tool_call>{not json}</tool_call>")[1] == []
    msg = for_template({"role": "assistant", "content": None, "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{\"a\": 1}"}}]})
    assert msg["tool_calls"][0]["function"]["arguments"] == {"a": 1} and msg["content"] == ""


def test_protocol_parsing_errors_name_the_field():
    base = TurnParams()
    ok = chat_request.parse_chat({"messages": [{"role": "user", "content": "x"}], "stop": "END", "max_tokens": 5,
                              "specprefill": {"mass": 0.5}, "specattn": {"p": 0.9}}, base, None)
    assert ok.params.sampling.stop == ("END",) and ok.params.sampling.max_tokens == 5
    assert ok.params.prefill.selection.mass == 0.5
    assert ok.params.decoding.mode == "specattn" and ok.params.decoding.specattn_p == 0.9
    assert chat_request.parse_chat({"messages": [{"role": "user", "content": "x"}], "specprefill": False},
                               base, "h").params.prefill.enabled is False
    cases = [
        ({"messages": []}, InvalidRequest, "messages"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, InvalidRequest, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "temperature": 9}, ConfigError, "temperature"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, InvalidRequest, "'n'"),
        ({"messages": [{"role": "user", "content": "x"}], "grammar": "root ::= x"}, InvalidRequest, "grammar"),
        ({"messages": [{"role": "user", "content": "x"}], "specprefill": {"speed": 1}}, InvalidRequest, "speed"),
        ({"messages": [{"role": "user", "content": "x"}], "specprefill": {"specattn": True}}, InvalidRequest,
         "specattn"),  # decoding is not a prefill field
        ({"messages": [{"role": "user", "content": "x"}], "specprefill": {"gamma": 2}}, InvalidRequest, "gamma"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "x"}]}, InvalidRequest, "tools"),
        ([1, 2], InvalidRequest, "JSON object"),
    ]
    for body, exc, word in cases:
        with pytest.raises(exc, match=word):
            chat_request.parse_chat(body, base, None)


def test_turn_result_parses_calls_once_with_stable_ids():
    result = Result("Checking.\n" + CALL, "stop", [1, 2], Timings(context_n=10, cache_n=4, predicted_n=2))
    turn = chat_request.turn_result(result, TOOLS)
    (call,) = turn.tool_calls
    assert turn.finish_reason == "tool_calls" and turn.message["content"] == "Checking."
    body = openai_chat_objects.completion("id", "m", turn, "s1")
    chunks = openai_chat_objects.final_chunks("id", "m", turn, "s1", include_usage=True)
    # the completion body, the last stream chunks and the history all carry the same call id
    assert body["choices"][0]["message"]["tool_calls"][0]["id"] == call["id"]
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0]["id"] == call["id"]
    assert turn.message["tool_calls"][0]["id"] == call["id"]
    assert chunks[1]["choices"][0]["finish_reason"] == "tool_calls" and chunks[1]["session_id"] == "s1"
    assert chunks[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                                  "prompt_tokens_details": {"cached_tokens": 4}}
    plain = chat_request.turn_result(Result("Sunny.", "length", [1], Timings()), TOOLS)
    assert plain.message == {"role": "assistant", "content": "Sunny."} and plain.finish_reason == "length"
    cut = chat_request.turn_result(Result(CALL + "\n" + CALL[:20], "length", [1], Timings()), TOOLS)
    assert len(cut.tool_calls) == 1 and cut.finish_reason == "length"  # the cut is reported, not hidden
    cancelled = chat_request.turn_result(Result("Sun", "cancelled", [1], Timings()), None)
    assert cancelled.finish_reason == "cancelled" and cancelled.openai_finish_reason == "stop"


def stream(pieces: list[str], final_text: str) -> str:
    held = tool_calls.StreamFilter()
    shown = "".join(x for p in pieces for x in held.feed(p) if isinstance(x, str))  # the text, not the calls
    message = chat_request.turn_result(Result(final_text, "stop", [], Timings()), TOOLS).message
    return shown + held.release(message)


def test_stream_filter_hides_calls_and_shows_everything_else():
    prose = ["The weather ", "in Oslo is ", "mild <tool", "s> are handy."]
    assert stream(prose, "".join(prose)) == "".join(prose)  # a false alarm is released in order
    with_call = ["Checking.", "\n<tool_", "call>\n{\"name\": ", "\"get_weather\", \"arguments\": {}}", "</tool_call>"]
    assert stream(with_call, "".join(with_call)) == "Checking.\n"
    bare = ['{"name": "get_weather",', ' "arguments": {"city": "Oslo"}}']
    assert stream(bare, "".join(bare)) == ""  # a bare JSON call never shows as content
    json_answer = ['{"temp": ', "21}"]
    assert stream(json_answer, "".join(json_answer)) == '{"temp": 21}'  # JSON that is not a call is content
    broken = ["Hmm ", "<tool_call>{oops"]
    assert stream(broken, "".join(broken)) == "Hmm <tool_call>{oops"


def test_timings_serializer_has_one_name_per_figure():
    t = Timings(specprefill="active", context_n=1000, cache_n=200, prompt_n=300, prompt_ms=1500.0,
                predicted_n=10, predicted_ms=500.0, speculator_prefill_n=800)
    js = t.to_json()
    assert js["prompt_n"] == 300 and js["prompt_per_second"] == 200.0 and js["predicted_per_second"] == 20.0
    assert js["decode_mode"] == "plain" and "draft_n" not in js
    for gone in ("kept_n", "prefill_ms", "spec_prefill_ms", "spec_cache_n", "spec_prefill_n"):
        assert gone not in js
    assert round(t.kept_pct, 1) == 37.5
    t.decode_mode, t.speculative = "specattn", SpeculativeStats(n_drafted=8, n_accepted=6, cells_attended=25,
                                                                cells_total=100)
    js = t.to_json()
    assert js["draft_acceptance"] == 0.75 and js["kv_selected_fraction"] == 0.25
