"""HTTP routes besides the turn protocols: models, sessions, health, readiness, metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from aiohttp import web

from core.errors import InvalidRequest, ShuttingDown
from gateway import keys
from gateway.auth import OWNER
from gateway.bodies import read_json

routes = web.RouteTableDef()


@routes.get("/v1/models")
async def models(request: web.Request) -> web.Response:
    """The one model, with the limit clients size their prompts and compaction by: the
    longest prompt a turn may send (``context_length``, vLLM's ``max_model_len``,
    Anthropic-style ``context_window``; past the model's window, ``kv_window``, a session
    keeps its most important cells), and the most a reply may take (``max_output_tokens``)."""
    app = request.app
    cfg, limits = app[keys.CONFIG].engine, app[keys.CONFIG].gateway.limits
    window, limit = min(cfg.n_ctx, cfg.speculator_ctx_len), cfg.context_limit
    return web.json_response({"object": "list", "data": [{
        "id": app[keys.CONFIG].gateway.model_name, "object": "model", "created": int(app[keys.STARTED]),
        "owned_by": "specgate", "target": Path(cfg.target).name, "speculator": Path(cfg.speculator).name,
        "context_length": limit, "max_model_len": limit, "context_window": limit, "kv_window": window,
        "max_output_tokens": min(limits.max_tokens_cap, window)}]})


@routes.post("/v1/sessions")
async def create_session(request: web.Request) -> web.Response:
    body = await read_json(request) if request.can_read_body else {}
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if request.app[keys.RUNNER].draining:
        raise ShuttingDown("the server is shutting down; create the session on another replica")
    session = await request.app[keys.MANAGER].create(request[OWNER], body.get("id"))
    return web.json_response(session_view(request, session), status=201, headers={"X-SpecGate-Session": session.id})


def session_view(request: web.Request, session: Any) -> dict[str, Any]:
    manager = request.app[keys.MANAGER]
    return {**session.meta(), "kv": manager.location(session), **manager.store_view()}


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
    manager, draining = request.app[keys.MANAGER], request.app[keys.RUNNER].draining
    body = {**await manager.readiness(), "draining": draining}
    ok = manager.models_ready and not draining
    return web.json_response({"ready": ok, **body}, status=200 if ok else 503)


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    return web.Response(body=request.app[keys.METRICS].render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})
