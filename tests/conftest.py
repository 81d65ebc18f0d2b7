"""Shared fixtures: real models (fetched by the README's test command) and tiny
models derived from the real speculator with the ``gguf`` package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core import model_store
from core.config import EngineConfig
from core.engine import Engine
from core.gguf_tools import truncate_blocks


def real_model(spec: model_store.ModelSpec) -> Path:
    path = model_store.model_path(spec)
    if not model_store.is_verified(spec, path):
        pytest.fail(f"{spec.name} missing at {path}: run `specgate fetch-models` (the README's test "
                    "command does this)")
    return path


def derived_dir() -> Path:
    d = Path(os.environ.get("SPECGATE_DERIVED_DIR", model_store.models_dir() / "derived"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def tiny(n_blocks: int, spec: model_store.ModelSpec = model_store.SPECULATOR) -> Path:
    """A copy of a real model (the speculator by default) with only its first ``n_blocks``
    blocks (cached)."""
    src = real_model(spec)
    dst = derived_dir() / f"{spec.name}-{n_blocks}blk-{spec.sha256[:8]}.gguf"
    if not dst.exists():
        truncate_blocks(src, dst, n_blocks)
    return dst


@pytest.fixture(scope="session")
def tiny_speculator() -> Path:
    return tiny(2)


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    return tiny(3)


@pytest.fixture(scope="session")
def small_model() -> Path:
    return real_model(model_store.SMALL)


@pytest.fixture(scope="session")
def tiny_engine(tiny_speculator: Path, tiny_target: Path):
    engine = Engine(EngineConfig(target=str(tiny_target), speculator=str(tiny_speculator),
                                 n_ctx=4096, n_threads=2, calibrate_tokens=64))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smol_engine(small_model: Path):
    """A real, coherent small model as both speculator and target: greedy outputs
    without the near-ties of the truncated models (for exact-equality tests)."""
    engine = Engine(EngineConfig(target=str(small_model), speculator=str(small_model),
                                 n_ctx=4096, n_threads=2, calibrate_tokens=64))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smol_pair_engine(small_model: Path):
    """Full SmolLM2 as target, its first 20 blocks as draft: a draft that agrees often
    but not always, so speculative rounds both accept and reject."""
    engine = Engine(EngineConfig(target=str(small_model), speculator=str(tiny(20, model_store.SMALL)),
                                 n_ctx=4096, n_threads=2, calibrate_tokens=64))
    yield engine
    engine.close()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A real redis-server on a free loopback port, no persistence."""

    def __init__(self) -> None:
        import shutil
        import subprocess
        import time

        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not installed: run ops/test.sh, which installs it")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                client.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.05)
        else:
            self.stop()
            pytest.fail("redis-server did not start")
        self.client = client

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer()
    yield server
    server.stop()


class GatewayThread:
    """The real aiohttp app on a loopback port, served from its own thread and loop."""

    def __init__(self, gateway, engine, policy) -> None:
        import asyncio
        import threading

        from aiohttp import web

        from gateway.app import create_app

        self.port = gateway.port
        self.base = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.app = create_app(gateway, engine, policy)
        self.runner = web.AppRunner(self.app)
        ready = threading.Event()
        self.error: BaseException | None = None

        def serve() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.runner.setup())
                site = web.TCPSite(self.runner, "127.0.0.1", self.port)
                self.loop.run_until_complete(site.start())
            except BaseException as exc:  # surfaced to the test
                self.error = exc
                ready.set()
                return
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        ready.wait(300)
        if self.error is not None:
            raise self.error

    def call(self, coro):
        import asyncio
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(60)


def start_gateway(target: Path, speculator: Path, **gateway_kwargs):
    from core.config import GatewayConfig, PolicyConfig

    gw = GatewayConfig(port=free_port(), **gateway_kwargs)
    engine = EngineConfig(target=str(target), speculator=str(speculator), n_ctx=4096, n_threads=2,
                          calibrate_tokens=64)
    return GatewayThread(gw, engine, PolicyConfig(min_tokens=0, break_even=False, mass=0.6))


@pytest.fixture(scope="module")
def gateway(tiny_target: Path, tiny_speculator: Path, redis_server):
    server = start_gateway(tiny_target, tiny_speculator, redis_url=redis_server.url, max_queue=4)
    yield server
    server.stop()
