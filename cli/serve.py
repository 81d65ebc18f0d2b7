"""``specgate serve``: the HTTP/WebSocket gateway on the configured models."""

from __future__ import annotations

import argparse


def run(args: argparse.Namespace) -> int:
    from aiohttp import web

    from core.config import ServeConfig, build, override
    from core.model_files import with_default_models
    from gateway.app import create_app
    from gateway.logs import configure

    config = build(ServeConfig, vars(args))
    config = override(config, engine=with_default_models(config.engine))
    configure(config.gateway.log_level)
    web.run_app(create_app(config), host=config.gateway.host, port=config.gateway.port, print=None,
                access_log=None)
    return 0
