"""The aiohttp application factory and the lifecycles of its resources.

Every resource is a cleanup context, started in order and closed in reverse: the
session layer (models, store, admission, sessions: sessions/layer.py), then the
HTTP client that relays turns to other replicas.  :func:`drain` is the graceful half of a
shutdown (see ``specgate serve``): it runs on SIGTERM while the server still
listens, and again, as a no-op, from ``on_shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

import aiohttp
import structlog
from aiohttp import WSCloseCode, web

from core.models.model_files import models_dir
from core.policies import TurnParams
from gateway import (
    auth,
    client_hints,
    keys,
)
from gateway.error_responses import REJECTED, Handler, error_middleware
from gateway.forward import route_to_owner, tag_replica
from gateway.metrics import Metrics
from gateway.serve_config import GatewayConfig, ServeConfig
from gateway.turns import TurnRunner
from gateway.wire import openapi, specgate_api, websocket
from gateway.wire.anthropic import routes as anthropic
from gateway.wire.openai_chat import routes as openai_chat
from gateway.wire.openai_responses import routes as openai_responses
from sessions.layer import LayerSettings, open_layer

log = structlog.get_logger("specgate.http")
T = TypeVar("T")


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("X-Request-Id") or f"req-{uuid.uuid4().hex[:12]}"
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id[:64],
                                           session_id=request.headers.get(client_hints.SESSION_HEADER))
    t0 = time.perf_counter()
    response = await handler(request)
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    request.app[keys.METRICS].request(route, response.status)
    if request.path not in ("/health", "/metrics"):
        log.info("request_end", method=request.method, path=request.path, status=response.status,
                 ms=round((time.perf_counter() - t0) * 1e3, 1))
    if not response.prepared:
        response.headers.setdefault("X-Request-Id", request_id[:64])
    return response


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    if request.app[keys.LOCAL_ONLY]:
        auth.check_local(request)
    if request.path not in auth.OPEN_PATHS:
        request[auth.OWNER] = request.app[keys.API_KEYS].owner(request.headers.get("Authorization"),
                                                              request.headers.get("x-api-key"))
    return await handler(request)


def layer_settings(config: ServeConfig, replica_id: str) -> LayerSettings:
    gw = config.gateway
    return LayerSettings(replica_id=replica_id, advertise_url=advertise_url(gw), redis_url=gw.redis_url,
                         session_ttl_s=gw.session_ttl_s, lease_ms=gw.lease_ms, max_queue=gw.max_queue,
                         kv_budget_mb=gw.kv_budget_mb, kv_spill_dir=gw.kv_spill_dir,
                         kv_spill_max_mb=gw.kv_spill_max_mb, kv_tier_dir=tier_dir(gw.kv_tier_dir),
                         kv_tier_max_mb=gw.kv_tier_max_mb, catch_up_tokens=gw.catch_up_tokens,
                         kv_checkpoint_tokens=gw.kv_checkpoint_tokens, kv_tier_secret=gw.kv_tier_secret,
                         kv_tier_timeout_s=gw.kv_tier_timeout_s, kv_tier_queue_mb=gw.kv_tier_queue_mb,
                         isolate_conversations=gw.isolate_conversations,
                         prefix_min_tokens=gw.prefix_min_tokens, splice_min_tokens=gw.splice_min_tokens,
                         implicit_min_share=gw.implicit_min_share, close_timeout_s=min(5.0, gw.drain_timeout_s),
                         limits=gw.limits)


def tier_dir(configured: str) -> str:
    """``auto``: the cache dir, beside the models (so a restart finds what it wrote)."""
    return str(models_dir().parent / "kv-tier") if configured == "auto" else configured


def advertise_url(cfg: GatewayConfig) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    return cfg.advertise_url or f"http://{host}:{cfg.port}"


async def sessions_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[keys.CONFIG]
    async with open_layer(config.engine, layer_settings(config, app[keys.REPLICA_ID])) as manager:
        gw = config.gateway
        runner = TurnRunner(manager, app[keys.METRICS], gw.auto_create_sessions, gw.implicit_sessions)
        app[keys.MANAGER], app[keys.RUNNER] = manager, runner
        app[keys.METRICS].live.read = lambda: {**manager.figures(), "running_turns": len(runner.turns)}
        yield


async def http_client_ctx(app: web.Application) -> AsyncIterator[None]:
    """The client that proxies turns to a session's owner (gateway/forward.py)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=2)) as client:
        app[keys.HTTP_CLIENT] = client
        yield


async def drain(app: web.Application) -> None:
    """Graceful shutdown: ``/ready`` and new turns answer 503, running turns get
    ``drain_timeout_s`` to finish, WebSockets close with 1001, records are flushed."""
    runner = app.get(keys.RUNNER)
    if runner is None or runner.draining:
        return
    cfg = app[keys.CONFIG].gateway
    log.info("drain_start", running=len(runner.turns), timeout_s=cfg.drain_timeout_s)
    cancelled = await runner.drain(cfg.drain_timeout_s)
    sockets = app[keys.WEBSOCKETS]
    for ws in tuple(sockets):
        await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")
    manager = app[keys.MANAGER]
    settle_s, hand_s = max(5.0, cfg.drain_timeout_s), min(5.0, cfg.drain_timeout_s)
    kv = await _step("settle_kv", manager.settle_kv(settle_s), settle_s + STEP_SLACK_S, {})
    flushed, released = await _step("hand_over", manager.hand_over(hand_s), hand_s + STEP_SLACK_S, (False, 0))
    log.info("drain_done", cancelled=cancelled, store_flushed=flushed, leases_released=released, **kv)


STEP_SLACK_S = 10.0  # past a drain step's own deadline before it is given up


async def _step(name: str, work: Awaitable[T], limit_s: float, fallback: T) -> T:
    """``work``'s result, or ``fallback`` when it runs past ``limit_s``: every drain step bounds
    itself, and one that still does not return must not keep the process from stopping.  Its
    threads' and tasks' stacks go to stderr, for the bug report."""
    try:
        return await asyncio.wait_for(work, limit_s)
    except TimeoutError:
        log.error("drain_step_timeout", step=name, limit_s=limit_s)
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a stderr without a file
            faulthandler.dump_traceback(all_threads=True)
            for task in asyncio.all_tasks():
                task.print_stack(file=sys.stderr)
        return fallback


SHUTDOWN_S = 5.0


def app_runner(app: web.Application) -> web.AppRunner:
    """The runner every server uses: a client that leaves cancels its handler (and so its turn).
    Its cleanup runs after :func:`drain`, so the handlers still open then (a proxied relay, a
    slow client) get a few seconds, not aiohttp's 60: a replica that was asked to stop exits
    in a bounded time, which a rolling restart waits on."""
    return web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_S)


def create_app(config: ServeConfig) -> web.Application:
    app = web.Application(middlewares=[request_context, error_middleware, authenticate, route_to_owner],
                          client_max_size=config.gateway.max_body_mb << 20)
    gw = config.gateway
    app[keys.REPLICA_ID] = gw.replica_id or f"{socket.gethostname()}-{gw.port}"
    app.on_response_prepare.append(tag_replica)
    app[keys.CONFIG] = config
    app[keys.DEFAULTS] = TurnParams(prefill=config.prefill, decoding=config.decoding)
    app[keys.STARTED] = time.time()
    app[keys.METRICS] = metrics = Metrics()
    app[REJECTED] = lambda code: metrics.rejected.labels(code).inc()
    app[keys.API_KEYS] = api_keys = auth.ApiKeys.from_config(config.gateway)
    app[keys.WEBSOCKETS] = set()
    auth.warn_if_exposed(config.gateway, api_keys)
    app[keys.LOCAL_ONLY] = auth.guards_origin(config.gateway, api_keys)
    app.cleanup_ctx.extend([sessions_ctx, http_client_ctx])
    app.on_shutdown.append(drain)
    for wire_routes in (openai_chat.routes, anthropic.routes, openai_responses.routes, specgate_api.routes,
                        websocket.routes, openapi.routes):
        app.add_routes(wire_routes)
    return app
