"""The aiohttp application factory and the lifecycles of its resources.

Every resource is a cleanup context, started in order and closed in reverse:
models (on their worker thread) -> metadata store -> scheduler and sessions.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import structlog
from aiohttp import web

from core.config import ServeConfig, TurnParams
from core.worker import ModelState, ModelWorker
from gateway import http_api, keys, ws_api
from gateway.errors import Handler, error_middleware
from gateway.metrics import Metrics
from gateway.turns import TurnRunner
from sessions.manager import SessionManager
from sessions.metadata import open_store
from sessions.parked_kv import ParkedKV
from sessions.scheduler import FairScheduler

log = structlog.get_logger("specgate.http")


@web.middleware
async def request_context(request: web.Request, handler: Handler) -> web.StreamResponse:
    request_id = request.headers.get("X-Request-Id") or f"req-{uuid.uuid4().hex[:12]}"
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(request_id=request_id, session_id=request.headers.get("X-Session-Id"))
    t0 = time.perf_counter()
    response = await handler(request)
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    request.app[keys.METRICS].request(route, response.status)
    if request.path not in ("/health", "/metrics"):
        log.info("request_end", method=request.method, path=request.path, status=response.status,
                 ms=round((time.perf_counter() - t0) * 1e3, 1))
    if not response.prepared:
        response.headers.setdefault("X-Request-Id", request_id)
    return response


async def worker_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[keys.CONFIG].engine
    worker = ModelWorker(engine)
    app[keys.WORKER] = worker
    t0 = time.perf_counter()
    await worker.start()
    log.info("models_loaded", target=engine.target, speculator=engine.speculator,
             ms=round((time.perf_counter() - t0) * 1e3))
    if worker.state is ModelState.READY:
        lmap = await worker.call(lambda engine: engine.layer_map)
        log.info("layer_map", source=lmap.source, mapping=list(lmap.mapping))
    yield
    await worker.close()


async def store_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[keys.CONFIG].gateway
    store = open_store(cfg.redis_url, cfg.session_ttl_s)
    app[keys.STORE] = store
    log.info("store_opened", kind=store.kind, reachable=await store.ping())
    yield
    await store.close()


async def sessions_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[keys.CONFIG].gateway
    scheduler = FairScheduler(cfg.max_queue)
    parked = ParkedKV(cfg.kv_budget_mb << 20, cfg.kv_spill_dir or None)
    manager = SessionManager(app[keys.WORKER], app[keys.STORE], parked, scheduler)
    metrics = app[keys.METRICS]
    app[keys.SCHEDULER], app[keys.PARKED], app[keys.MANAGER] = scheduler, parked, manager
    app[keys.RUNNER] = TurnRunner(manager, metrics, cfg.auto_create_sessions)
    metrics.gauges.update({
        "specgate_live_sessions": lambda: manager.live,
        "specgate_kv_bytes_ram": lambda: parked.bytes_in_ram,
        "specgate_kv_evictions": lambda: parked.evictions,
        "specgate_queue_depth": lambda: scheduler.depth,
    })
    scheduler.start()
    yield
    await scheduler.stop()


def create_app(config: ServeConfig) -> web.Application:
    app = web.Application(middlewares=[request_context, error_middleware],
                          client_max_size=config.gateway.max_body_mb << 20)
    app[keys.CONFIG] = config
    app[keys.DEFAULTS] = TurnParams(prefill=config.prefill, decoding=config.decoding)
    app[keys.STARTED] = time.time()
    app[keys.METRICS] = Metrics()
    app.cleanup_ctx.extend([worker_ctx, store_ctx, sessions_ctx])
    app.add_routes(http_api.routes)
    app.add_routes(ws_api.routes)
    return app
