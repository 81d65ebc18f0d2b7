"""OpenAI Chat Completions: ``POST /v1/chat/completions``, plain and streamed (SSE).

The body parses into the internal :class:`~gateway.protocol.ChatRequest`
(``protocol.parse_chat``); the finished turn renders as a ``chat.completion``
object, or as ``chat.completion.chunk`` events closed by ``data: [DONE]``.
"""

from __future__ import annotations

from aiohttp import web

from gateway import client_hints, keys, protocol, sse
from gateway.bodies import json_response, read_json
from gateway.error_responses import error_body
from gateway.openai_chat_objects import chunk, completion, final_chunks, new_id
from gateway.protocol import TurnResult
from gateway.tool_calls import CallArgs, CallStart
from gateway.turn_http import begin, complete, session_headers

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    config = app[keys.CONFIG]
    req = protocol.parse_chat(await read_json(request), app[keys.DEFAULTS],
                              request.headers.get(client_hints.SESSION_HEADER), config.gateway.limits,
                              config.engine.n_ctx, client_hints.header_hint(request.headers))
    turn = await begin(request, req)
    model = config.gateway.model_name
    headers = session_headers(turn)
    if req.stream:
        return await sse.stream(request, turn, ChunkEncoder(new_id(), model, req.session_id, req.include_usage),
                                headers)
    result = await complete(request, turn)
    return json_response(completion(new_id(), model, result, req.session_id), headers=headers)


class ChunkEncoder:
    """``chat.completion.chunk`` events: the role, content pieces, the closing chunks, ``[DONE]``."""

    def __init__(self, req_id: str, model: str, session_id: str | None, include_usage: bool) -> None:
        self.req_id, self.model, self.session_id, self.include_usage = req_id, model, session_id, include_usage
        self.streamed: dict[int, str] = {}  # each streamed call's arguments sent so far

    async def settle(self, result: TurnResult) -> None:
        return None

    def start(self) -> list[bytes]:
        return [sse.frame(chunk(self.req_id, self.model, {"role": "assistant", "content": ""}))]

    def text(self, piece: str) -> list[bytes]:
        return [sse.frame(chunk(self.req_id, self.model, {"content": piece}))]

    def call(self, piece: CallStart | CallArgs) -> list[bytes]:
        """A call's id and name when it starts, then its arguments in pieces, as OpenAI streams them."""
        if isinstance(piece, CallStart):
            self.streamed[piece.index] = ""
            delta = {"index": piece.index, "id": piece.id, "type": "function",
                     "function": {"name": piece.name, "arguments": ""}}
        else:
            self.streamed[piece.index] += piece.fragment
            delta = {"index": piece.index, "function": {"arguments": piece.fragment}}
        return [sse.frame(chunk(self.req_id, self.model, {"tool_calls": [delta]}))]

    def finish(self, result: TurnResult) -> list[bytes]:
        return [*(sse.frame(c) for c in final_chunks(self.req_id, self.model, result, self.session_id,
                                                     self.include_usage, self.streamed)), sse.frame("[DONE]")]

    def keepalive(self) -> list[bytes]:
        return [sse.COMMENT]

    def error(self, exc: BaseException) -> list[bytes]:
        return [sse.frame(error_body(exc)[1]), sse.frame("[DONE]")]
