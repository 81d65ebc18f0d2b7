"""Typed application keys: every shared resource of the aiohttp app."""

from __future__ import annotations

import aiohttp
from aiohttp import web

from core.policies import TurnParams
from gateway.auth import ApiKeys
from gateway.metrics import Metrics
from gateway.serve_config import ServeConfig
from gateway.turns import TurnRunner
from sessions.manager import SessionManager

CONFIG = web.AppKey("config", ServeConfig)
DEFAULTS = web.AppKey("defaults", TurnParams)  # the server's turn policies, before request overrides
STARTED = web.AppKey("started", float)
MANAGER = web.AppKey("manager", SessionManager)
METRICS = web.AppKey("metrics", Metrics)
RUNNER = web.AppKey("runner", TurnRunner)
API_KEYS = web.AppKey("api_keys", ApiKeys)
LOCAL_ONLY = web.AppKey("local_only", bool)  # keyless on loopback: refuse foreign Origin and Host (gateway/auth.py)
WEBSOCKETS = web.AppKey("websockets", set[web.WebSocketResponse])  # open sockets, closed on drain
REPLICA_ID = web.AppKey("replica_id", str)
HTTP_CLIENT = web.AppKey("http_client", aiohttp.ClientSession)  # proxies turns to a session's owner
