"""HTTP routes: OpenAI chat completions (plain and SSE), models, sessions, health, metrics."""

from __future__ import annotations

from typing import Any

import orjson
import structlog
from aiohttp import web

from core.errors import InvalidRequest
from gateway import keys, protocol
from gateway.errors import error_body
from gateway.turns import Turn

log = structlog.get_logger("specgate.http")
routes = web.RouteTableDef()
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise InvalidRequest("the request body is empty; expected JSON")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from exc


def dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    app = request.app
    req = protocol.parse_chat(await read_json(request), app[keys.DEFAULTS], request.headers.get("X-Session-Id"))
    structlog.contextvars.bind_contextvars(session_id=req.session_id)
    runner = app[keys.RUNNER]
    session = await runner.session_for(req.session_id)
    log.info("request_start", stream=req.stream, n_messages=len(req.messages), tools=bool(req.tools))
    turn = runner.start(req, session)
    model = app[keys.CONFIG].gateway.model_name
    if req.stream:
        return await stream_turn(request, turn, model)
    try:
        async for _ in turn.pieces():
            if request.transport is None or request.transport.is_closing():
                turn.cancel.set()  # the client left: stop generating for nobody
        result = await turn.result()
    finally:
        turn.cancel.set()
    return web.json_response(protocol.completion(protocol.new_id(), model, result, req.session_id), dumps=dumps)


async def stream_turn(request: web.Request, turn: Turn, model: str) -> web.StreamResponse:
    """SSE: role chunk, content chunks, a final chunk with finish_reason and timings,
    an optional usage chunk, then ``data: [DONE]``.  A client that goes away cancels
    generation at the next token."""
    req_id = protocol.new_id()
    resp = web.StreamResponse(headers=SSE_HEADERS)

    async def send(obj: dict[str, Any] | str) -> None:
        payload = obj if isinstance(obj, str) else dumps(obj)
        await resp.write(f"data: {payload}\n\n".encode())

    try:
        await resp.prepare(request)
        await send(protocol.chunk(req_id, model, {"role": "assistant", "content": ""}))
        async for piece in turn.pieces():
            await send(protocol.chunk(req_id, model, {"content": piece}))
        try:
            result = await turn.result()
        except Exception as exc:  # headers are out: report in-band
            _, body = error_body(exc)
            await send(body)
            await send("[DONE]")
            return resp
        for final in protocol.final_chunks(req_id, model, result, turn.request.session_id,
                                           turn.request.include_usage):
            await send(final)
        await send("[DONE]")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError) as exc:
        turn.cancel.set()
        log.info("client_disconnected", error=type(exc).__name__)
        if turn.task is not None:
            await _quietly(turn)
    finally:
        turn.cancel.set()
    return resp


async def _quietly(turn: Turn) -> None:
    try:
        await turn.result()
    except Exception as exc:
        log.info("turn_after_disconnect_failed", error=str(exc))


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    app = request.app
    cfg = app[keys.CONFIG].engine
    return web.json_response({"object": "list", "data": [{
        "id": app[keys.CONFIG].gateway.model_name, "object": "model", "created": int(app[keys.STARTED]),
        "owned_by": "specgate", "target": cfg.target, "speculator": cfg.speculator}]})


@routes.post("/v1/sessions")
async def create_session(request: web.Request) -> web.Response:
    body = await read_json(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    session_id = body.get("id")
    manager = request.app[keys.MANAGER]
    if session_id is not None and await manager.exists(session_id):
        raise InvalidRequest(f"session {session_id!r} already exists")
    session = await manager.create(session_id)
    return web.json_response(session_view(request, session), status=201)


def session_view(request: web.Request, session: Any) -> dict[str, Any]:
    manager = request.app[keys.MANAGER]
    return {**session.meta(), "kv": manager.location(session), "store_synced": session.store_synced,
            "store": manager.store.kind}


@routes.get("/v1/sessions/{id}")
async def get_session(request: web.Request) -> web.Response:
    session = await request.app[keys.MANAGER].get(request.match_info["id"])
    return web.json_response(session_view(request, session))


@routes.delete("/v1/sessions/{id}")
async def delete_session(request: web.Request) -> web.Response:
    await request.app[keys.MANAGER].delete(request.match_info["id"])
    return web.json_response({"id": request.match_info["id"], "object": "session", "deleted": True})


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    app = request.app
    worker, store = app[keys.WORKER], app[keys.STORE]
    store_ok = await store.ping()
    body = {"models": worker.state.value, "store": store.kind, "store_reachable": store_ok,
            "queue_depth": app[keys.SCHEDULER].depth}
    ok = worker.state.value == "ready" and store_ok
    return web.json_response({"ready": ok, **body}, status=200 if ok else 503)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    return web.Response(text=request.app[keys.METRICS].render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})
