"""Typed application keys: every shared resource of the aiohttp app."""

from __future__ import annotations

from aiohttp import web

from core.config import EngineConfig, GatewayConfig, PolicyConfig
from core.worker import ModelWorker
from gateway.metrics import Metrics
from gateway.turns import TurnRunner
from sessions.kv_store import KVStore
from sessions.manager import SessionManager
from sessions.scheduler import FairScheduler
from sessions.store import MetadataStore

GATEWAY = web.AppKey("gateway", GatewayConfig)
ENGINE = web.AppKey("engine", EngineConfig)
POLICY = web.AppKey("policy", PolicyConfig)
STARTED = web.AppKey("started", float)
WORKER = web.AppKey("worker", ModelWorker)
STORE = web.AppKey("store", MetadataStore)
KV = web.AppKey("kv", KVStore)
SCHEDULER = web.AppKey("scheduler", FairScheduler)
MANAGER = web.AppKey("manager", SessionManager)
METRICS = web.AppKey("metrics", Metrics)
RUNNER = web.AppKey("runner", TurnRunner)
