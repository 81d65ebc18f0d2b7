"""Chat Completions' response objects: ``chat.completion``, ``chat.completion.chunk`` and
``usage``, built from the one :class:`~gateway.chat_request.TurnResult` (pure: no model, no
server)."""

from __future__ import annotations

import time
import uuid
from typing import Any

from core.results import Timings
from gateway import tool_calls
from gateway.chat_request import TurnResult


def usage(t: Timings) -> dict[str, Any]:
    return {"prompt_tokens": t.context_n, "completion_tokens": t.predicted_n,
            "total_tokens": t.context_n + t.predicted_n,
            "prompt_tokens_details": {"cached_tokens": t.cache_n}}


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex[:24]}"


def completion(req_id: str, model: str, turn: TurnResult, session_id: str | None) -> dict[str, Any]:
    body = {
        "id": req_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": [{"index": 0, "message": turn.message, "finish_reason": turn.openai_finish_reason,
                     "logprobs": None}],
        "usage": usage(turn.timings), "timings": turn.timings.to_json(),
    }
    if session_id:
        body["session_id"] = session_id
    return body


def chunk(req_id: str, model: str, delta: dict[str, Any], finish: str | None = None,
          **extra: Any) -> dict[str, Any]:
    return {"id": req_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}


def final_chunks(req_id: str, model: str, turn: TurnResult, session_id: str | None,
                 include_usage: bool, streamed: dict[int, str] | None = None) -> list[dict[str, Any]]:
    """The stream's closing chunks: what is left of the tool calls (``streamed``: the
    arguments already sent of each call that streamed), the finish reason with the
    timings, then ``usage`` when the client asked for it."""
    out = []
    sent = streamed or {}
    rest = []
    for i, c in enumerate(turn.tool_calls):
        if i not in sent:
            rest.append({"index": i, **c})
        elif tail := tool_calls.unsent(c["function"]["arguments"], sent[i]):
            rest.append({"index": i, "function": {"arguments": tail}})
    if rest:
        out.append(chunk(req_id, model, {"tool_calls": rest}))
    extra: dict[str, Any] = {"timings": turn.timings.to_json()}
    if session_id:
        extra["session_id"] = session_id
    out.append(chunk(req_id, model, {}, turn.openai_finish_reason, **extra))
    if include_usage:
        out.append({"id": req_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model, "choices": [], "usage": usage(turn.timings)})
    return out
