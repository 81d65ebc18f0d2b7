"""OpenAI Chat Completions: ``POST /v1/chat/completions``, plain and streamed (SSE).

The body parses into the internal :class:`~gateway.chat_request.ChatRequest`
(``chat_request.parse_chat``: the chat form is the internal one)."""

from __future__ import annotations

from aiohttp import web

from gateway import chat_request, client_hints, keys, sse
from gateway.bodies import json_response, off_loop, read_json
from gateway.turn_http import begin, complete, session_headers
from gateway.wire.openai_chat.encoder import ChunkEncoder
from gateway.wire.openai_chat.objects import completion, new_id

routes = web.RouteTableDef()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    config = app[keys.CONFIG]
    req = await off_loop(chat_request.parse_chat, await read_json(request), app[keys.DEFAULTS],
                         request.headers.get(client_hints.SESSION_HEADER), config.gateway.limits,
                         config.engine.context_limit, client_hints.header_hint(request.headers))
    turn = await begin(request, req)
    model = config.gateway.model_name
    headers = session_headers(turn)
    if req.stream:
        return await sse.stream(request, turn, ChunkEncoder(new_id(), model, req.session_id, req.include_usage),
                                headers)
    result = await complete(request, turn)
    return json_response(completion(new_id(), model, result, req.session_id), headers=headers)
