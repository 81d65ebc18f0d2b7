"""A proxied stream whose owner dies ends in its protocol's own words, as the SDKs read them:
the anthropic client raises on it (a bare ``data:`` error it would ignore, leaving a silently
truncated reply), and a Responses stream ends with a valid ``response.failed``."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from core.config import Limits
from core.errors import OwnerLost
from core.policies import TurnParams
from gateway.forward import StreamTail
from gateway.wire.anthropic.encoder import MessageEncoder
from gateway.wire.openai_responses.encoder import Builder, ResponseEncoder
from gateway.wire.openai_responses.parse import parse_body

LOST = OwnerLost("the replica serving this session stopped mid-stream")


def relayed(path: str, head: list[bytes]) -> bytes:
    """``head`` relayed in odd-sized chunks (as iter_any hands them over), then the tail."""
    tail, body = StreamTail(path), b"".join(head)
    for i in range(0, len(body), 7):
        tail.feed(body[i:i + 7])
    return body + tail.end(LOST)


def serving(payload: bytes, lib=httpx):  # noqa: ANN001 -- httpx, or the httpx2 the anthropic SDK runs on
    """A real HTTP client whose transport answers every request with ``payload``."""
    return lib.Client(transport=lib.MockTransport(
        lambda _: lib.Response(200, headers={"Content-Type": "text/event-stream"}, content=payload)))


def test_the_anthropic_client_raises_on_a_lost_owner():
    enc = MessageEncoder("msg_1", "m")
    payload = relayed("/v1/messages", [*enc.start(), *enc.text("Hello, wor")])
    import httpx2

    client = anthropic.Anthropic(base_url="http://replica", api_key="k", http_client=serving(payload, httpx2))
    with pytest.raises(anthropic.APIStatusError, match="stopped mid-stream"):
        for _ in client.messages.create(model="m", max_tokens=8, stream=True,
                                        messages=[{"role": "user", "content": "hi"}]):
            pass


def test_a_responses_stream_ends_with_response_failed():
    req = parse_body({"input": "hi"}, [], TurnParams(), Limits(), 4096)
    enc = ResponseEncoder(Builder("resp_1", "m", req), None)  # type: ignore[arg-type]
    payload = relayed("/v1/responses", [*enc.start(), *enc.text("Hello, "), *enc.text("wor")])
    client = openai.OpenAI(base_url="http://replica/v1", api_key="k", http_client=serving(payload))
    events = list(client.responses.create(model="m", input="hi", stream=True))
    adapter = TypeAdapter(ResponseStreamEvent)  # the SDK builds its objects unvalidated: check the wire
    for line in payload.decode().splitlines():
        if line.startswith("data: "):
            adapter.validate_json(line[6:])
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-2].type == "error" and events[-1].type == "response.failed"
    assert events[-2].code == "owner_lost" and events[-1].response.id == "resp_1"
    assert events[-1].response.error.code == "server_error"  # the API's own codes only


def test_a_chat_stream_still_ends_with_an_error_chunk_and_done():
    payload = relayed("/v1/chat/completions", [b'data: {"id": "c", "choices": []}\n\n'])
    assert payload.endswith(b'"code":"owner_lost"}}\n\ndata: [DONE]\n\n')
