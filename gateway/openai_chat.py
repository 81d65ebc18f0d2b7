"""OpenAI Chat Completions: ``POST /v1/chat/completions``, plain and streamed (SSE).

The body parses into the internal :class:`~gateway.protocol.ChatRequest`
(``protocol.parse_chat``); the finished turn renders as a ``chat.completion``
object, or as ``chat.completion.chunk`` events closed by ``data: [DONE]``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from core.results import Timings
from gateway import keys, protocol, sse
from gateway.bodies import json_response, read_json
from gateway.errors import error_body
from gateway.protocol import TurnResult
from gateway.turn_http import begin, complete

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    config = app[keys.CONFIG]
    req = protocol.parse_chat(await read_json(request), app[keys.DEFAULTS], request.headers.get("X-Session-Id"),
                              config.gateway.limits, config.engine.n_ctx)
    turn = await begin(request, req)
    model = config.gateway.model_name
    headers = {"X-Session-Id": req.session_id} if req.session_id else None
    if req.stream:
        return await sse.stream(request, turn, ChunkEncoder(new_id(), model, req.session_id, req.include_usage),
                                headers)
    result = await complete(request, turn)
    return json_response(completion(new_id(), model, result, req.session_id), headers=headers)


class ChunkEncoder:
    """``chat.completion.chunk`` events: the role, content pieces, the closing chunks, ``[DONE]``."""

    def __init__(self, req_id: str, model: str, session_id: str | None, include_usage: bool) -> None:
        self.req_id, self.model, self.session_id, self.include_usage = req_id, model, session_id, include_usage

    async def settle(self, result: TurnResult) -> None:
        return None

    def start(self) -> list[bytes]:
        return [sse.frame(chunk(self.req_id, self.model, {"role": "assistant", "content": ""}))]

    def text(self, piece: str) -> list[bytes]:
        return [sse.frame(chunk(self.req_id, self.model, {"content": piece}))]

    def finish(self, result: TurnResult) -> list[bytes]:
        return [*(sse.frame(c) for c in final_chunks(self.req_id, self.model, result, self.session_id,
                                                     self.include_usage)), sse.frame("[DONE]")]

    def error(self, exc: BaseException) -> list[bytes]:
        return [sse.frame(error_body(exc)[1]), sse.frame("[DONE]")]


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
                 include_usage: bool) -> list[dict[str, Any]]:
    """The stream's closing chunks: the tool calls (if any), the finish reason with the
    timings, then ``usage`` when the client asked for it."""
    out = []
    if calls := turn.tool_calls:
        out.append(chunk(req_id, model, {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}))
    extra: dict[str, Any] = {"timings": turn.timings.to_json()}
    if session_id:
        extra["session_id"] = session_id
    out.append(chunk(req_id, model, {}, turn.openai_finish_reason, **extra))
    if include_usage:
        out.append({"id": req_id, "object": "chat.completion.chunk", "created": int(time.time()),
                    "model": model, "choices": [], "usage": usage(turn.timings)})
    return out
