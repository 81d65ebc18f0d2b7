"""The aiohttp application factory and the lifecycles of its resources.

Every resource is a cleanup context, started in order and closed in reverse:
models (on their worker thread) -> metadata store and its writer -> scheduler,
sessions and the expiry sweeper.  :func:`drain` is the graceful half of a
shutdown (see ``specgate serve``): it runs on SIGTERM while the server still
listens, and again, as a no-op, from ``on_shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import structlog
from aiohttp import WSCloseCode, web

from core.policies import TurnParams
from core.runtime.worker import ModelState, ModelWorker
from gateway import (
    anthropic_messages,
    auth,
    client_hints,
    http_api,
    keys,
    openai_chat,
    openai_responses,
    openapi,
    ws_api,
)
from gateway.error_responses import REJECTED, Handler, error_middleware
from gateway.forward import route_to_owner, tag_replica
from gateway.metrics import Metrics
from gateway.serve_config import GatewayConfig, ServeConfig
from gateway.turns import TurnRunner
from sessions.admission import FairAdmission
from sessions.kv.parked import ParkedKV
from sessions.manager import SessionManager
from sessions.metadata import RedisStore, open_store
from sessions.registry import LocalRegistry, RedisRegistry
from sessions.store_writer import StoreWriter

log = structlog.get_logger("specgate.http")


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


async def worker_ctx(app: web.Application) -> AsyncIterator[None]:
    engine = app[keys.CONFIG].engine
    worker = ModelWorker(engine)
    app[keys.WORKER] = worker
    t0 = time.perf_counter()
    await worker.start()
    log.info("models_loaded", target=Path(engine.target).name, speculator=Path(engine.speculator).name,
             ms=round((time.perf_counter() - t0) * 1e3))
    if worker.state is ModelState.READY:
        lmap = await worker.call(lambda engine: engine.layer_map)
        log.info("layer_map", source=lmap.source, mapping=list(lmap.mapping))
    yield
    await worker.close()


async def store_ctx(app: web.Application) -> AsyncIterator[None]:
    cfg = app[keys.CONFIG].gateway
    store = open_store(cfg.redis_url, cfg.session_ttl_s, app[keys.REPLICA_ID])
    writer = StoreWriter(store)
    app[keys.STORE], app[keys.WRITER] = store, writer
    app[keys.REGISTRY] = registry = RedisRegistry(store.client, app[keys.REPLICA_ID], advertise_url(cfg),
                                                  cfg.lease_ms) if isinstance(store, RedisStore) \
        else LocalRegistry(app[keys.REPLICA_ID])
    log.info("store_opened", kind=store.kind, reachable=await store.ping(), replica=app[keys.REPLICA_ID])
    writer.start()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None, sock_connect=2)) as client:
        app[keys.HTTP_CLIENT] = client
        yield
    await registry.stop()
    await writer.stop(flush_timeout_s=min(5.0, cfg.drain_timeout_s))
    await store.close()


def advertise_url(cfg: GatewayConfig) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "::", "") else cfg.host
    return cfg.advertise_url or f"http://{host}:{cfg.port}"


def model_fingerprint(config: ServeConfig) -> bytes:
    """Which model pair a spilled KV file belongs to (names and sizes: cheap, and enough)."""
    parts = []
    for path in (config.engine.target, config.engine.speculator):
        p = Path(path)
        parts.append(f"{p.name}:{p.stat().st_size if p.exists() else 0}")
    return "|".join(parts).encode()


async def sessions_ctx(app: web.Application) -> AsyncIterator[None]:
    config = app[keys.CONFIG]
    cfg = config.gateway
    scheduler = FairAdmission(cfg.max_queue, config.engine.slots)
    parked = ParkedKV(cfg.kv_budget_mb << 20, cfg.kv_spill_dir or None, model_fingerprint(config),
                      cfg.kv_spill_max_mb << 20, namespace=app[keys.REPLICA_ID])
    manager = SessionManager(app[keys.WORKER], app[keys.STORE], parked, scheduler, app[keys.WRITER],
                             cfg.limits, cfg.session_ttl_s, app[keys.REGISTRY], cfg.prefix_min_tokens,
                             cfg.implicit_min_share)
    runner = TurnRunner(manager, app[keys.METRICS], cfg.auto_create_sessions, cfg.implicit_sessions)
    app[keys.SCHEDULER], app[keys.PARKED], app[keys.MANAGER], app[keys.RUNNER] = scheduler, parked, manager, runner
    live = app[keys.METRICS].live
    writer = app[keys.WRITER]
    live.gauges.update({
        "specgate_live_sessions": ("Sessions held in this process.", lambda: manager.live),
        "specgate_implicit_sessions": ("Sessions the server made for requests that name none.",
                                       lambda: manager.implicit_live),
        "specgate_running_turns": ("Turns running or queued.", lambda: len(runner.turns)),
        "specgate_queue_depth": ("Turns queued for the model thread, plus the running ones.",
                                 lambda: scheduler.depth),
        "specgate_slots_busy": ("Model slots running a turn.", lambda: manager.slots.busy),
        "specgate_slots_resident": ("Model slots holding a session's KV.", lambda: manager.slots.resident),
        "specgate_step_last_batch_rows": ("Decoding turns in the last batch of the step loop.",
                                          lambda: app[keys.WORKER].stats.last_rows),
        "specgate_kv_bytes_ram": ("Parked session KV held in RAM.", lambda: parked.bytes_in_ram),
        "specgate_kv_bytes_disk": ("Parked session KV spilled to disk.", lambda: parked.bytes_on_disk),
        "specgate_store_pending_writes": ("Session records waiting for the store.", lambda: writer.pending),
        "specgate_store_degraded": ("1 while store writes are failing.", lambda: int(writer.degraded)),
    })
    live.counters.update({
        "specgate_kv_evictions": ("Parked KV evicted from RAM.", lambda: parked.evictions),
        "specgate_steps": ("Steps of the model thread's loop.", lambda: app[keys.WORKER].stats.steps),
        "specgate_prefix_hits": ("Sessions that started from a cached system prompt.",
                                 lambda: manager.prefixes.hits),
        "specgate_prefix_misses": ("System prompts prefilled into the prefix cache.",
                                   lambda: manager.prefixes.misses),
        "specgate_prefix_waits": ("Sessions that waited for another turn to cache their system prompt.",
                                  lambda: manager.prefixes.waits),
        "specgate_prefix_adopted": ("Sessions that started from an idle resident session's prefix KV.",
                                    lambda: manager.prefixes.adopted),
        "specgate_implicit_hits": ("Requests naming no session that continued a held conversation.",
                                   lambda: manager.implicit_hits),
        "specgate_implicit_misses": ("Requests naming no session that matched no idle held conversation.",
                                     lambda: manager.implicit_misses),
        "specgate_implicit_reused_tokens": ("Target tokens reused by turns of implicit sessions.",
                                            lambda: manager.implicit_reused),
        "specgate_step_batches": ("Batches decoded by the step loop.", lambda: app[keys.WORKER].stats.batches),
        "specgate_step_batch_rows": ("Decoding turns' tokens over all batches (divide by batches: mean batch).",
                                     lambda: app[keys.WORKER].stats.batch_rows),
        "specgate_step_batch_tokens": ("Tokens over all batches (divide by batches: tokens per batch).",
                                       lambda: app[keys.WORKER].stats.batch_tokens),
        "specgate_step_chunk_stalls": ("Batches in which decoding turns shared the step with a prefill chunk.",
                                       lambda: app[keys.WORKER].stats.chunk_stalls),
        "specgate_step_stall_tokens": ("Prefill tokens carried by those batches (divide by stalls: mean chunk).",
                                       lambda: app[keys.WORKER].stats.stall_tokens),
        "specgate_spill_writes": ("KV spill files written.", lambda: parked.spill_writes),
        "specgate_spill_failures": ("KV spill writes that failed (the session rebuilds).",
                                    lambda: parked.spill_failures),
        "specgate_spill_rejected": ("KV spill files discarded by their checks.", lambda: parked.spill_rejected),
        "specgate_store_errors": ("Failed metadata store writes (retried).", lambda: writer.failed_writes),
        "specgate_store_rejected_writes": ("Record writes refused: another replica owns the session.",
                                           lambda: writer.rejected_writes),
        "specgate_store_dropped_writes": ("Records dropped for an error that is not an outage (logged).",
                                          lambda: writer.dropped_writes),
    })
    scheduler.start()
    app[keys.REGISTRY].start(manager.held, manager.forget)
    sweeper = asyncio.create_task(_sweep(manager, max(1.0, min(60.0, cfg.session_ttl_s / 10))),
                                  name="specgate-sweeper")
    yield
    sweeper.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sweeper
    await scheduler.stop()


async def _sweep(manager: SessionManager, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        manager.sweep()


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
    flushed = await app[keys.WRITER].flush(min(5.0, cfg.drain_timeout_s))
    await app[keys.REGISTRY].stop()  # first: a renewal after the release would claim the leases again
    released = await app[keys.REGISTRY].release(app[keys.MANAGER].held())  # other replicas take them now
    log.info("drain_done", cancelled=cancelled, store_flushed=flushed, leases_released=released)


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
    app.cleanup_ctx.extend([worker_ctx, store_ctx, sessions_ctx])
    app.on_shutdown.append(drain)
    app.add_routes(openai_chat.routes)
    app.add_routes(anthropic_messages.routes)
    app.add_routes(openai_responses.routes)
    app.add_routes(http_api.routes)
    app.add_routes(ws_api.routes)
    app.add_routes(openapi.routes)
    return app
