"""Each protocol's stream encoder driven by scripted replies (text, one call, parallel calls,
an empty reply, a length stop), its events checked one by one against the SDKs' own types and
for their order, and the calls put back together as a client does."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from typing import Any

import orjson
import pytest
from anthropic.types import RawMessageStreamEvent
from openai.types.chat import ChatCompletionChunk
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from core.config import Limits
from core.policies import TurnParams
from core.results import Result, Timings
from gateway import chat_request, tool_calls
from gateway.wire.anthropic.encoder import MessageEncoder
from gateway.wire.openai_chat.encoder import ChunkEncoder
from gateway.wire.openai_responses.encoder import Builder, ResponseEncoder
from gateway.wire.openai_responses.parse import parse_body

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": n, "description": "", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for n in ("get_weather", "get_time")]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_time", "arguments": {"city": "Tokyo"}}\n</tool_call>'
REPLIES = {
    "text": ("The weather is fine today.", "stop"),
    "one_call": (CALL, "stop"),
    "text_then_call": ("Let me look that up.\n" + CALL, "stop"),
    "parallel": (CALL + "\n" + CALL2, "stop"),
    "empty": ("", "stop"),
    "length": ("A reply cut short by max_to", "length"),
}
PREFIX = "t0"


def script(name: str, step: int = 3) -> tuple[list[tool_calls.Piece], chat_request.TurnResult]:
    """The pieces a turn streams for a scripted reply fed ``step`` characters at a time, and
    the turn's result."""
    text, finish = REPLIES[name]
    held = tool_calls.StreamFilter(tool_calls.names_of(TOOLS), PREFIX)
    pieces: list[tool_calls.Piece] = []
    for i in range(0, len(text), step):
        pieces += held.feed(text[i:i + step])
    result = chat_request.turn_result(Result(text, finish, [], Timings(context_n=10, predicted_n=5)), tuple(TOOLS),
                                      PREFIX)
    if tail := held.release(result.message):
        pieces.append(tail)
    return pieces, result


def run(encoder: Any, name: str) -> tuple[list[dict[str, Any]], chat_request.TurnResult]:
    pieces, result = script(name)
    frames = encoder.start()
    for piece in pieces:
        frames += encoder.text(piece) if isinstance(piece, str) else encoder.call(piece)
    asyncio.run(encoder.settle(result))
    frames += encoder.finish(result)
    return [parse_frame(f) for f in frames], result


def parse_frame(frame: bytes) -> dict[str, Any]:
    event, data = None, None
    for line in frame.decode().splitlines():
        if line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]
    assert data is not None, frame
    return {"event": event, "data": data if data == "[DONE]" else orjson.loads(data)}


def fragments(events: list[dict[str, Any]], kind: str) -> int:
    return sum(1 for e in events if isinstance(e["data"], dict) and e["data"].get("type") == kind)


# -- Anthropic -------------------------------------------------------------------------
ANTHROPIC = TypeAdapter(RawMessageStreamEvent)


@pytest.mark.parametrize("name", REPLIES)
def test_anthropic_events_are_valid_and_ordered(name):
    events, result = run(MessageEncoder("msg_1", "m"), name)
    typed = [ANTHROPIC.validate_python(e["data"]) for e in events if e["data"]["type"] != "ping"]
    assert all(e["event"] == e["data"]["type"] for e in events)
    assert typed[0].type == "message_start" and typed[-1].type == "message_stop"
    assert typed[-2].type == "message_delta"
    assert typed[-2].delta.stop_reason == {"length": "max_tokens"}.get(result.finish_reason,
                                                                      "tool_use" if result.tool_calls else "end_turn")
    blocks: dict[int, dict[str, Any]] = {}
    open_now: set[int] = set()
    for e in typed:  # each block starts once, gets deltas only while open, stops once, in index order
        if e.type == "content_block_start":
            assert e.index == len(blocks) and not open_now
            blocks[e.index] = {"block": e.content_block.model_dump(), "text": "", "json": ""}
            open_now.add(e.index)
        elif e.type == "content_block_delta":
            assert e.index in open_now
            key = "text" if e.delta.type == "text_delta" else "json"
            blocks[e.index][key] += e.delta.text if key == "text" else e.delta.partial_json
        elif e.type == "content_block_stop":
            open_now.remove(e.index)
    assert not open_now
    calls = [b for b in blocks.values() if b["block"]["type"] == "tool_use"]
    assert [(b["block"]["id"], b["block"]["name"], orjson.loads(b["json"])) for b in calls] == \
        [(c["id"], c["function"]["name"], orjson.loads(c["function"]["arguments"])) for c in result.tool_calls]
    texts = "".join(b["text"] for b in blocks.values() if b["block"]["type"] == "text")
    assert texts.strip() == (result.message["content"] or "").strip() or result.tool_calls


# -- Responses --------------------------------------------------------------------------
RESPONSES = TypeAdapter(ResponseStreamEvent)


def responses_encoder() -> ResponseEncoder:
    req = parse_body({"input": "hi", "tools": [
        {"type": "function", "name": t["function"]["name"], "parameters": t["function"]["parameters"]}
        for t in TOOLS]}, [], TurnParams(), Limits(), 4096)

    async def keep(_: dict[str, Any]) -> None:
        return None
    return ResponseEncoder(Builder("resp_1", "m", req), keep)


@pytest.mark.parametrize("name", REPLIES)
def test_responses_events_are_valid_numbered_and_ordered(name):
    events, result = run(responses_encoder(), name)
    typed = [RESPONSES.validate_python(e["data"]) for e in events]
    assert [e.sequence_number for e in typed] == list(range(len(typed)))
    assert typed[0].type == "response.created" and typed[-1].type == "response.completed"
    final = typed[-1].response
    added = [e for e in typed if e.type == "response.output_item.added"]
    done = [e for e in typed if e.type == "response.output_item.done"]
    assert [e.output_index for e in added] == list(range(len(added))) == [e.output_index for e in done]
    assert [e.item.model_dump(exclude_none=True) for e in done] == \
        [i.model_dump(exclude_none=True) for i in final.output][: len(done)]
    args: dict[int, str] = defaultdict(str)
    for e in typed:
        if e.type == "response.function_call_arguments.delta":
            args[e.output_index] += e.delta
    for item in (e.item for e in done if e.item.type == "function_call"):
        assert args[next(e.output_index for e in done if e.item is item)] == item.arguments
    assert [i.call_id for i in final.output if i.type == "function_call"] == [c["id"] for c in result.tool_calls]


# -- Chat Completions ----------------------------------------------------------------------
@pytest.mark.parametrize("name", REPLIES)
def test_chat_chunks_are_valid_and_calls_add_up(name):
    events, result = run(ChunkEncoder("chatcmpl-1", "m", None, True), name)
    assert events[-1]["data"] == "[DONE]"
    chunks = [ChatCompletionChunk.model_validate(e["data"]) for e in events[:-1]]
    calls: dict[int, dict[str, str]] = {}
    content = ""
    for c in chunks:
        for choice in c.choices:
            content += choice.delta.content or ""
            for d in choice.delta.tool_calls or ():  # as the openai SDK's stream helper accumulates
                slot = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                if d.function:
                    slot["name"] += d.function.name or ""
                    slot["arguments"] += d.function.arguments or ""
    assert [calls[i] for i in sorted(calls)] == [{"id": c["id"], "name": c["function"]["name"],
                                                  "arguments": c["function"]["arguments"]} for c in result.tool_calls]
    finishes = [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason]
    assert finishes == [result.openai_finish_reason]
    assert chunks[-1].usage is not None and chunks[-1].choices == []
    if not result.tool_calls:
        assert content == (result.message["content"] or "")


# -- arguments in fragments ----------------------------------------------------------------
@pytest.mark.parametrize("make, kind", [
    (lambda: MessageEncoder("msg_1", "m"), "content_block_delta"),
    (responses_encoder, "response.function_call_arguments.delta"),
])
def test_call_arguments_arrive_in_many_fragments(make, kind):
    events, _ = run(make(), "one_call")
    assert fragments(events, kind) > 3


def test_chat_call_arguments_arrive_in_many_fragments():
    events, _ = run(ChunkEncoder("chatcmpl-1", "m", None, False), "one_call")
    pieces = [d for e in events[:-1] for d in e["data"]["choices"][0]["delta"].get("tool_calls", ())
              if d.get("function", {}).get("arguments")]
    assert len(pieces) > 3


def test_a_call_streams_while_it_is_written_not_at_the_end():
    """The call's start and first arguments come out before its closing tag is written."""
    text = REPLIES["one_call"][0]
    held = tool_calls.StreamFilter(tool_calls.names_of(TOOLS), PREFIX)
    cut = text.index('"Paris') + 4
    early = held.feed(text[:cut])
    assert isinstance(early[0], tool_calls.CallStart) and early[0].name == "get_weather"
    assert "".join(p.fragment for p in early[1:] if isinstance(p, tool_calls.CallArgs)) == '{"city": "Par'


def test_a_call_to_an_unknown_tool_does_not_stream():
    held = tool_calls.StreamFilter({"get_time"}, PREFIX)
    assert held.feed(CALL) == []
