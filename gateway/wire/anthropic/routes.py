"""The Anthropic Messages API's routes: ``POST /v1/messages`` (plain and streamed) and
``POST /v1/messages/count_tokens``."""

from __future__ import annotations

from aiohttp import web

from gateway import keys, sse
from gateway.auth import OWNER
from gateway.bodies import json_response, off_loop, read_json
from gateway.turn_http import begin, complete, session_headers
from gateway.turns import to_turn
from gateway.wire.anthropic.encoder import MessageEncoder, message, new_id
from gateway.wire.anthropic.parse import parse

routes = web.RouteTableDef()


@routes.post("/v1/messages")
async def create_message(request: web.Request) -> web.StreamResponse:
    req = await off_loop(parse, await read_json(request), request)
    turn = await begin(request, req)
    model = req.model or request.app[keys.CONFIG].gateway.model_name
    headers = session_headers(turn)
    if req.stream:
        return await sse.stream(request, turn, MessageEncoder(new_id(), model), headers)
    return json_response(message(new_id(), model, await complete(request, turn)), headers=headers)


@routes.post("/v1/messages/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    if isinstance(body, dict):
        body = {**body, "max_tokens": 1}  # count_tokens takes no max_tokens
    req = await off_loop(parse, body, request)
    prompt = await request.app[keys.MANAGER].render(to_turn(req, request[OWNER]), check=False)
    return json_response({"input_tokens": len(prompt.tokens)})
