"""The OpenAI Responses API's routes: ``POST /v1/responses`` (plain and streamed),
``GET``/``DELETE /v1/responses/{id}`` and ``POST /v1/responses/input_tokens``."""

from __future__ import annotations

from aiohttp import web

from gateway import keys, sse
from gateway.auth import OWNER
from gateway.bodies import json_response, off_loop, read_json
from gateway.turn_http import begin, complete
from gateway.turns import to_turn
from gateway.wire.openai_responses.encoder import Builder, ResponseEncoder
from gateway.wire.openai_responses.parse import parse
from gateway.wire.openai_responses.store import body_of, continued, keep, new_id, stored

routes = web.RouteTableDef()


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    body = await read_json(request)
    session, history = await continued(request, body)
    req = await off_loop(parse, body, request, history)
    if session is None and req.store and req.chat.session_id:  # kept apart from the named session, as ids say
        session = await request.app[keys.MANAGER].start_implicit(request[OWNER], required=True)
    turn = await begin(request, req.chat, session, keep=req.store)  # stored: kept so a follow-up continues it
    session = turn.session
    held = len(session.messages) if session is not None else 0  # what this conversation held before the turn
    resp_id = new_id(session)
    model = req.chat.model or request.app[keys.CONFIG].gateway.model_name
    built = Builder(resp_id, model, req)
    if req.chat.stream:
        return await sse.stream(request, turn, ResponseEncoder(built, lambda r: keep(request, session, r, held)))
    out = built.response(await complete(request, turn))
    await keep(request, session, out, held)
    return json_response(out)


@routes.get("/v1/responses/{id}")
async def get_response(request: web.Request) -> web.Response:
    _, entry = await stored(request, request.match_info["id"])
    return json_response(body_of(entry))


@routes.delete("/v1/responses/{id}")
async def delete_response(request: web.Request) -> web.Response:
    resp_id = request.match_info["id"]
    session, _ = await stored(request, resp_id)
    manager = request.app[keys.MANAGER]
    session.responses = [r for r in session.responses if r["id"] != resp_id]
    if session.responses or not session.implicit:
        manager.mirror(session)
    else:
        await manager.delete(session.owner, session.id)
    return json_response({"id": resp_id, "object": "response", "deleted": True})


@routes.post("/v1/responses/input_tokens")
async def input_tokens(request: web.Request) -> web.Response:
    body = await read_json(request)
    _, history = await continued(request, body)
    req = await off_loop(parse, body, request, history)
    prompt = await request.app[keys.MANAGER].render(to_turn(req.chat, request[OWNER]), check=False)
    return json_response({"object": "response.input_tokens", "input_tokens": len(prompt.tokens)})
