"""The session layer, opened as one resource: the models on their thread, then the metadata
store with its writer and lease registry, then admission, parked KV, the session manager and
the expiry sweeper; closed in reverse.  The gateway opens it from one cleanup context
(gateway/app.py) and meets it through the :class:`SessionManager` it yields."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import structlog

from core.config import EngineConfig, Limits
from core.models.model_files import models_dir
from core.runtime.messages import Describe
from core.runtime.worker import ModelState, ModelWorker
from sessions.admission import FairAdmission
from sessions.kv.parked import ParkedKV
from sessions.kv.tier import DirectoryTier, KVTier, TierSettings
from sessions.kv.tier_redis import RedisTier
from sessions.kv.tier_secret import tier_secret
from sessions.manager import SessionManager
from sessions.metadata import MetadataStore, RedisStore, open_store
from sessions.registry import LocalRegistry, RedisRegistry, Registry
from sessions.store_writer import StoreWriter

log = structlog.get_logger("specgate.sessions")


@dataclass(slots=True, frozen=True)
class LayerSettings:
    """What the session layer takes from ``specgate serve``'s configuration."""

    replica_id: str
    advertise_url: str  # where other replicas reach this one
    redis_url: str = ""  # empty: the in-process store
    session_ttl_s: int = 86400
    lease_ms: int = 15000
    max_queue: int = 64
    kv_budget_mb: int = 2048
    kv_spill_dir: str = ""
    kv_spill_max_mb: int = 8192
    kv_tier_dir: str = ""  # a folder or a Redis URL; empty: no tier
    kv_tier_max_mb: int = 16384
    catch_up_tokens: int = 256  # 0: no idle catch-up
    kv_checkpoint_tokens: int = 1024  # 0: no session checkpoints in the tier
    kv_tier_secret: str = ""  # empty: generated once into the cache dir (sessions.kv.tier_secret)
    kv_tier_timeout_s: float = 5.0
    kv_tier_queue_mb: int = 2048
    isolate_conversations: bool = False
    prefix_min_tokens: int = 256
    splice_min_tokens: int = 0
    implicit_min_share: float = 0.5
    close_timeout_s: float = 5.0  # what the writer gets to flush on close
    limits: Limits = Limits()


def model_fingerprint(engine: EngineConfig, layout: str = "") -> bytes:
    """Which model pair, KV cache type and state layout (``Engine.state_layout``: slots, KV
    layout, flash attention, V transposition) a saved KV file belongs to: names and sizes,
    cheap and enough; a state saved with other settings does not load, or loads wrong."""
    parts = []
    for path in (engine.target, engine.speculator):
        p = Path(path)
        parts.append(f"{p.name}:{p.stat().st_size if p.exists() else 0}")
    return "|".join([*parts, engine.kv_type, layout]).encode()


def open_tier(where: str, settings: TierSettings) -> KVTier | None:
    """The KV tier ``--kv-tier-dir`` names: a Redis URL, a folder, or none (empty)."""
    if not where:
        return None
    if where.startswith(("redis://", "rediss://", "unix://")):
        return RedisTier(where, settings)
    return DirectoryTier(where, settings)


@contextlib.asynccontextmanager
async def open_layer(engine: EngineConfig, s: LayerSettings) -> AsyncIterator[SessionManager]:
    async with contextlib.AsyncExitStack() as stack:
        worker = await stack.enter_async_context(_models(engine))
        store, writer, registry = await stack.enter_async_context(_store(s))
        admission = FairAdmission(s.max_queue, engine.slots)
        fingerprint = model_fingerprint(engine, await worker.call(Describe.STATE_LAYOUT))
        parked = ParkedKV(s.kv_budget_mb << 20, s.kv_spill_dir or None, fingerprint,
                          s.kv_spill_max_mb << 20, namespace=s.replica_id)
        tier = await asyncio.to_thread(open_tier, s.kv_tier_dir, TierSettings(
            fingerprint, s.kv_tier_max_mb << 20, tier_secret(s.kv_tier_secret, models_dir().parent) if
            s.kv_tier_dir else b"", s.kv_tier_queue_mb << 20, s.kv_tier_timeout_s))
        if tier is not None:
            stack.push_async_callback(asyncio.to_thread, tier.close, s.close_timeout_s)  # before the models close
            log.info("kv_tier_opened", where=tier.where, max_mb=s.kv_tier_max_mb, fingerprint=tier.tag)
        manager = SessionManager(worker, store, parked, admission, writer, s.limits, s.session_ttl_s, registry,
                                 s.prefix_min_tokens, s.implicit_min_share, tier, s.kv_checkpoint_tokens,
                                 0 if s.isolate_conversations else s.splice_min_tokens, s.isolate_conversations)
        # prefix entries copied, scorers caught up, sessions checkpointed
        worker.attach(manager.residency, s.catch_up_tokens)
        admission.start()
        stack.push_async_callback(admission.stop)
        registry.start(manager.held, manager.forget)
        sweeper = asyncio.create_task(_sweep(manager, max(1.0, min(60.0, s.session_ttl_s / 10))),
                                      name="specgate-sweeper")
        stack.push_async_callback(_cancel, sweeper)
        yield manager


@contextlib.asynccontextmanager
async def _models(engine: EngineConfig) -> AsyncIterator[ModelWorker]:
    worker = ModelWorker(engine)
    t0 = time.perf_counter()
    await worker.start()
    log.info("models_loaded", target=Path(engine.target).name, speculator=Path(engine.speculator).name,
             ms=round((time.perf_counter() - t0) * 1e3))
    if worker.state is ModelState.READY:
        lmap = await worker.call(Describe.LAYER_MAP)
        log.info("layer_map", source=lmap.source, mapping=list(lmap.mapping))
    try:
        yield worker
    finally:
        await worker.close()


@contextlib.asynccontextmanager
async def _store(s: LayerSettings) -> AsyncIterator[tuple[MetadataStore, StoreWriter, Registry]]:
    store = open_store(s.redis_url, s.session_ttl_s, s.replica_id)
    writer = StoreWriter(store)
    registry: Registry = RedisRegistry(store.client, s.replica_id, s.advertise_url, s.lease_ms) \
        if isinstance(store, RedisStore) else LocalRegistry(s.replica_id)
    log.info("store_opened", kind=store.kind, reachable=await store.ping(), replica=s.replica_id)
    writer.start()
    try:
        yield store, writer, registry
    finally:
        await registry.stop()
        await writer.stop(flush_timeout_s=s.close_timeout_s)
        await store.close()


async def _sweep(manager: SessionManager, every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        manager.sweep()


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
