"""``specgate serve``: the HTTP/WebSocket gateway on the configured models.

SIGTERM (or Ctrl-C) drains before it stops: while the socket still listens,
``/ready`` answers 503 and new turns 503 ``shutting_down``, running turns get
``drain_timeout_s`` to finish, WebSockets close with 1001 and session records
are flushed to the store; then the server closes.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from gateway.serve_config import ServeConfig


async def serve(config: ServeConfig) -> None:
    from aiohttp import web

    from gateway.app import app_runner, create_app, drain

    app = create_app(config)
    runner = app_runner(app)
    await runner.setup()
    await web.TCPSite(runner, config.gateway.host, config.gateway.port).start()
    import structlog

    structlog.get_logger("specgate.serve").info(
        "listening", url=f"http://{config.gateway.host}:{config.gateway.port}",
        openai_base_url=f"http://{config.gateway.host}:{config.gateway.port}/v1",
        anthropic_base_url=f"http://{config.gateway.host}:{config.gateway.port}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
        await drain(app)
    finally:
        t0 = time.monotonic()
        await runner.cleanup()
        structlog.get_logger("specgate.serve").info("stopped", cleanup_s=round(time.monotonic() - t0, 2))


def run(args: argparse.Namespace) -> int:
    from cli.logs import configure
    from core.loader import build, override
    from core.models.model_files import with_default_models
    from gateway.serve_config import ServeConfig

    config = build(ServeConfig, vars(args))
    config = override(config, engine=with_default_models(config.engine))
    configure(config.gateway.log_level)
    asyncio.run(serve(config))
    return 0
