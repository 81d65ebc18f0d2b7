"""HTTP routes: OpenAI chat completions (plain and SSE), models, sessions, health, metrics."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import structlog
from aiohttp import web

from core.errors import InvalidRequest, ShuttingDown
from gateway import keys, protocol
from gateway.auth import OWNER
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
    config = app[keys.CONFIG]
    req = protocol.parse_chat(await read_json(request), app[keys.DEFAULTS], request.headers.get("X-Session-Id"),
                              config.gateway.limits, config.engine.n_ctx)
    structlog.contextvars.bind_contextvars(session_id=req.session_id)
    runner = app[keys.RUNNER]
    session = await runner.session_for(request[OWNER], req.session_id)
    log.info("request_start", stream=req.stream, n_messages=len(req.messages), tools=bool(req.tools))
    turn = runner.start(req, session, request[OWNER])  # 409, 429 and 503 are answered here, before any stream starts
    model = config.gateway.model_name
    if req.stream:
        return await stream_turn(request, turn, model)
    try:
        async for _ in turn.pieces():
            pass
        result = await turn.result()
    except asyncio.CancelledError:  # the client left (handler cancellation): stop generating for nobody
        app[keys.METRICS].disconnects.labels("http").inc()
        log.info("client_disconnected", stream=False)
        raise
    finally:
        turn.abandon()
    headers = {"X-Session-Id": req.session_id} if req.session_id else None
    return web.json_response(protocol.completion(protocol.new_id(), model, result, req.session_id), dumps=dumps,
                             headers=headers)


async def stream_turn(request: web.Request, turn: Turn, model: str) -> web.StreamResponse:
    """SSE: role chunk, content chunks, a final chunk with finish_reason and timings,
    an optional usage chunk, then ``data: [DONE]``.  A client that goes away cancels
    generation at the next token."""
    req_id = protocol.new_id()
    session_id = turn.request.session_id
    resp = web.StreamResponse(headers={**SSE_HEADERS, **({"X-Session-Id": session_id} if session_id else {})})

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
            log.warning("stream_error", error=str(exc), error_type=type(exc).__name__)
            _, body = error_body(exc)
            await send(body)
            await send("[DONE]")
            return resp
        for final in protocol.final_chunks(req_id, model, result, turn.request.session_id,
                                           turn.request.include_usage):
            await send(final)
        await send("[DONE]")
        await resp.write_eof()
    except (ConnectionResetError, ConnectionError, asyncio.CancelledError) as exc:
        request.app[keys.METRICS].disconnects.labels("sse").inc()
        log.info("client_disconnected", stream=True, error=type(exc).__name__)
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        turn.abandon()
    return resp


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    app = request.app
    cfg = app[keys.CONFIG].engine
    return web.json_response({"object": "list", "data": [{
        "id": app[keys.CONFIG].gateway.model_name, "object": "model", "created": int(app[keys.STARTED]),
        "owned_by": "specgate", "target": Path(cfg.target).name, "speculator": Path(cfg.speculator).name}]})


@routes.post("/v1/sessions")
async def create_session(request: web.Request) -> web.Response:
    body = await read_json(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if request.app[keys.RUNNER].draining:
        raise ShuttingDown("the server is shutting down; create the session on another replica")
    session = await request.app[keys.MANAGER].create(request[OWNER], body.get("id"))
    return web.json_response(session_view(request, session), status=201, headers={"X-Session-Id": session.id})


def session_view(request: web.Request, session: Any) -> dict[str, Any]:
    manager = request.app[keys.MANAGER]
    return {**session.meta(), "kv": manager.location(session), "store": manager.store.kind,
            "store_synced": not manager.writer.degraded}


@routes.get("/v1/sessions/{id}")
async def get_session(request: web.Request) -> web.Response:
    session = await request.app[keys.MANAGER].get(request[OWNER], request.match_info["id"])
    return web.json_response(session_view(request, session))


@routes.delete("/v1/sessions/{id}")
async def delete_session(request: web.Request) -> web.Response:
    await request.app[keys.MANAGER].delete(request[OWNER], request.match_info["id"])
    return web.json_response({"id": request.match_info["id"], "object": "session", "deleted": True})


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@routes.get("/ready")
async def ready(request: web.Request) -> web.Response:
    """Ready to take turns: models loaded and not draining.  A store that is down leaves the
    gateway serving (``degraded``: records are buffered and replayed) rather than unready."""
    app = request.app
    worker, store = app[keys.WORKER], app[keys.STORE]
    try:
        store_ok = await asyncio.wait_for(store.ping(), 1.0)
    except TimeoutError:
        store_ok = False
    draining = app[keys.RUNNER].draining
    body = {"models": worker.state.value, "store": store.kind, "store_reachable": store_ok,
            "degraded": not store_ok or app[keys.WRITER].degraded, "draining": draining,
            "queue_depth": app[keys.SCHEDULER].depth}
    ok = worker.state.value == "ready" and not draining
    return web.json_response({"ready": ok, **body}, status=200 if ok else 503)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[keys.METRICS].render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})
