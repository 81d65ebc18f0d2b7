"""Helpers the tests share: real and derived models, a real redis-server, and the
real gateway app served on a loopback port."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.common import free_port
from core.config import EngineConfig, Limits
from core.loader import override
from core.models import model_files
from core.models.scorer_cuts import derived
from core.policies import DecodingPolicy, PrefillPolicy, SamplingParams, Selection, TurnParams
from gateway.serve_config import GatewayConfig, ServeConfig

# what the gateway tests serve by default: SpecPrefill on every prompt, no break-even
# no bridging: which gaps get bridged follows costs measured on this machine under its load
TEST_PREFILL = PrefillPolicy(min_tokens=0, break_even=False, bridge=False, selection=Selection(mass=0.6))


def real_model(spec: model_files.ModelSpec) -> Path:
    path = model_files.model_path(spec)
    if not model_files.is_verified(spec, path):
        pytest.fail(f"{spec.name} missing at {path}: run `specgate fetch-models` (the README's test "
                    "command does this)")
    return path


def tiny(n_blocks: int, spec: model_files.ModelSpec = model_files.SPECULATOR) -> Path:
    """A copy of a real model (the speculator by default) with only its first ``n_blocks``
    blocks (cached)."""
    real_model(spec)
    return derived(n_blocks, spec)


def engine_config(target: Path, speculator: Path, **fields: Any) -> EngineConfig:
    # the fixtures' speculators are chosen drafts (an identical model, a 20-block cut), so they score and draft
    # as given; the default Q4_0 copy has its own test, and the `specgate serve` processes run it
    base: dict[str, Any] = {"n_ctx": 4096, "n_threads": 2, "calibrate_tokens": 64, "scorer": "speculator-full"}
    return EngineConfig(target=str(target), speculator=str(speculator), **{**base, **fields})


class RedisServer:
    """A real redis-server on a free loopback port, no persistence."""

    def __init__(self, port: int | None = None) -> None:
        import shutil
        import subprocess
        import time

        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not installed: run ops/test.sh, which installs it")
        self.port = port or free_port()
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


class GatewayThread:
    """The real aiohttp app on a loopback port, served from its own thread and loop."""

    def __init__(self, config: ServeConfig) -> None:
        import asyncio
        import threading

        from aiohttp import web

        from gateway.app import app_runner, create_app

        self.port = config.gateway.port
        self.base = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        self.app = create_app(config)
        self.runner = app_runner(self.app)
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


def start_gateway(target: Path, speculator: Path, prefill: PrefillPolicy = TEST_PREFILL,
                  decoding: DecodingPolicy | None = None, engine: dict[str, Any] | None = None,
                  **gateway_kwargs: Any) -> GatewayThread:
    # replies the tiny models ramble on to max_tokens: keep the unset default at its old 256
    gateway_kwargs.setdefault("limits", Limits(default_max_tokens=256))
    gateway_kwargs.setdefault("kv_tier_dir", "")  # no KV tier unless a test asks: tests share no prefixes
    gateway_kwargs.setdefault("catch_up_tokens", 0)  # no idle catch-up unless asked: scorer figures stay exact
    gateway_kwargs.setdefault("kv_checkpoint_tokens", 0)  # no session checkpoints in a tier unless asked
    gw = GatewayConfig(port=free_port(), **gateway_kwargs)
    return GatewayThread(ServeConfig(gw, engine_config(target, speculator, **(engine or {})), prefill,
                                     decoding or DecodingPolicy()))


def policy(**fields: Any) -> TurnParams:
    """TurnParams from flat field names: prefill, selection and decoding fields alike."""
    return override(TurnParams(), **fields)


def forced(**fields: Any) -> TurnParams:
    """SpecPrefill on every prompt, the selection prefilled as chosen: no size floor and no
    cost decisions (break-even, gap bridging), which follow this machine's measured speeds."""
    return policy(**{"min_tokens": 0, "break_even": False, "bridge": False, **fields})


def with_sampling(params: TurnParams, sampling: SamplingParams) -> TurnParams:
    return dataclasses.replace(params, sampling=sampling)


class ServerProcess:
    """``specgate serve`` as a real child process (for signals, crashes and restarts)."""

    def __init__(self, target: Path, speculator: Path, *flags: str, env: dict[str, str] | None = None,
                 port: int | None = None) -> None:
        import os
        import subprocess
        import sys
        import time

        import httpx

        self.port = port or free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        exe = Path(sys.executable).parent / "specgate"
        self.log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"specgate-{self.port}.log", "w+b")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [str(exe), "serve", "--target", str(target), "--speculator", str(speculator), "--port", str(self.port),
             "--n-ctx", "4096", "--n-threads", "2", "--calibrate-tokens", "64", *flags],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "SPECGATE_KV_TIER_DIR": "", **(env or {})})  # a test's flags may name a tier
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"specgate serve exited with {self.proc.returncode}:\n{self.output()[-3000:]}")
            try:
                if httpx.get(self.base + "/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail("specgate serve did not become ready")

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read().decode(errors="replace")

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float = 60) -> int:
        return self.proc.wait(timeout)

    def stop(self) -> None:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except Exception:
                self.proc.kill()
        self.log.close()


def until(check: Callable[[], bool], timeout_s: float = 30.0, every_s: float = 0.02) -> bool:
    """Poll ``check`` until it holds or ``timeout_s`` passes (tests wait for events, not for time)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(every_s)
    return True


async def until_async(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """:func:`until` on an event loop: yields to the loop between polls."""
    import asyncio

    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.005)
    return True


class ModelThreadHeld:
    """Holds a gateway's model thread with a job of its own, so turns and renders stay queued for
    as long as a test needs (tiny models finish any real turn in milliseconds)."""

    def __init__(self, gw: GatewayThread) -> None:
        import asyncio
        import threading

        from gateway import keys

        self.release = threading.Event()
        self.future = asyncio.run_coroutine_threadsafe(
            gw.app[keys.MANAGER].worker.inspect(lambda engine: self.release.wait(60)), gw.loop)

    def __enter__(self) -> ModelThreadHeld:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.future.result(60)
