"""Serving benchmarks over HTTP: starting a server (SpecGate or llama-cpp-python's
``llama_cpp.server``) for a scenario, and ``overhead``: with tiny models, time
spent outside the model per request (client wall time minus the server's model
phases), and throughput with N concurrent sessions.  The agent session
scenario is bench/agent_session.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.common import free_port, progress, write_result
from core.config import EngineConfig


@contextlib.contextmanager
def redis_server() -> Iterator[int]:
    """A throwaway redis-server on a free port (no persistence) for the ``with`` block: its port."""
    import shutil

    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise RuntimeError("this bench needs redis-server (ops/test.sh installs it)")
    port = free_port()
    proc = subprocess.Popen([redis_bin, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and subprocess.run(
                ["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() != "PONG":
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path, pids: list[int] | None = None,
           env: dict[str, str] | None = None) -> Iterator[str]:
    """A server process for the ``with`` block; its pid is appended to ``pids``."""
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
        if pids is not None:
            pids.append(proc.pid)
        try:
            deadline = time.time() + 300
            while time.time() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/v1/models", timeout=2).status_code in (200, 401):  # 401: keys on
                        break
                time.sleep(1)
            else:
                raise RuntimeError(f"server did not come up: see {log}")
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):  # a bench may have SIGKILLed it
                os.killpg(proc.pid, signal.SIGTERM)
            _await_stop(proc, log)


STOP_WAIT_S = 180.0  # past the drain's own bounds (settle, hand-over, the tier's close), with room


def _await_stop(proc: subprocess.Popen[bytes], log: Path) -> None:
    """Wait for a SIGTERMed server; one that has not stopped by then is killed and said so
    (its log holds ``drain_step_timeout``'s stacks, when a drain step hung), and the bench
    goes on with its other arms."""
    try:
        proc.wait(STOP_WAIT_S)
    except subprocess.TimeoutExpired:
        print(f"SERVER DID NOT STOP in {STOP_WAIT_S:.0f} s after SIGTERM: killed, see {log}", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def rss_mb(pid: int) -> float:
    """A server process's resident memory now, in MB (OSError once the process has gone)."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), 0.0)


def metric(base: str, name: str) -> float:
    """One unlabelled figure from a server's ``/metrics`` (0.0 when it is not there)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    return next((float(x.split()[1]) for x in text.splitlines() if x.startswith(name + " ")), 0.0)


def specgate_cmd(port: int, engine: EngineConfig, **extra: Any) -> list[str]:
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--target", engine.target,
           "--speculator", engine.speculator, "--scorer", engine.scorer, "--n-ctx", str(engine.n_ctx),
           "--log-level", "warning"]
    extra.setdefault("kv_tier_dir", "")  # benches measure from cold unless they name a tier
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def llama_server_cmd(port: int, engine: EngineConfig, cache: bool) -> list[str]:
    """llama-cpp-python's server; it always reuses the live context's longest prefix,
    and ``--cache`` adds its RAM prompt cache of saved states on top.  Its default
    ``interrupt_requests`` cuts a streaming reply short when another request arrives
    (measured: 5 of 6 replies empty with two agents at once); off here, so concurrent
    requests queue instead."""
    threads = str(engine.n_threads)
    return [sys.executable, "-m", "llama_cpp.server", "--model", engine.target, "--n_ctx", str(engine.n_ctx),
            "--n_threads", threads, "--n_threads_batch", threads, "--flash_attn", "true",
            "--cache", str(cache).lower(), "--interrupt_requests", "false", "--port", str(port),
            "--host", "127.0.0.1"]


LLAMA_SERVER = Path(os.environ.get("SPECGATE_LLAMA_SERVER_DIR", Path.home() / ".cache/specgate/llama-server")) / \
    "bin/llama-server"


def native_server_cmd(port: int, engine: EngineConfig, slots: int, cache_ram_mb: int = 2048) -> list[str]:
    """llama.cpp's own server (``bash ops/build_llama_server.sh`` builds it from the sources
    llama-cpp-python vendors): ``slots`` parallel slots of ``n_ctx`` tokens each, continuous
    batching, its jinja chat template (tools), and its RAM prompt cache at SpecGate's KV budget."""
    if not LLAMA_SERVER.exists():
        raise RuntimeError(f"{LLAMA_SERVER} is missing: run bash ops/build_llama_server.sh")
    threads = str(engine.n_threads)
    return [str(LLAMA_SERVER), "-m", engine.target, "-np", str(slots), "-c", str(slots * engine.n_ctx),
            "-t", threads, "-tb", threads, "-fa", "on", "--jinja", "--no-webui", "--cache-ram", str(cache_ram_mb),
            "--host", "127.0.0.1", "--port", str(port)]


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


ROUTES = {  # the same small turn in each protocol
    "chat": ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 4}),
    "responses": ("/v1/responses", lambda text: {"input": text, "max_output_tokens": 4}),
    "messages": ("/v1/messages", lambda text: {"model": "m", "max_tokens": 4,
                                                "messages": [{"role": "user", "content": text}]}),
}


async def overhead_requests(base: str, n: int, route: str = "chat") -> list[float]:
    """Per request: client wall time less the model phases the server reports."""
    overheads = []
    path, body_of = ROUTES[route]
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for i in range(n):
            body = body_of(f"Say hello number {i}.")
            t0 = time.perf_counter()
            r = (await client.post(path, json=body)).json()
            wall_ms = (time.perf_counter() - t0) * 1e3
            t = r["timings"]
            overheads.append(wall_ms - (t["scoring_ms"] + t["prompt_ms"] + t["predicted_ms"]))
    return overheads


async def concurrent_sessions(base: str, n_sessions: int, turns: int) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=base, timeout=300) as client:
        ids = [(await client.post("/v1/sessions", json={})).json()["id"] for _ in range(n_sessions)]

        async def one(sid: str) -> int:
            messages: list[dict] = []
            tokens = 0
            for k in range(turns):
                messages.append({"role": "user", "content": f"Turn {k}: tell me something short."})
                r = (await client.post("/v1/chat/completions", headers={"X-SpecGate-Session": sid},
                                       json={"messages": messages, "max_tokens": 8})).json()
                messages.append(r["choices"][0]["message"])
                tokens += r["usage"]["completion_tokens"]
            return tokens

        t0 = time.perf_counter()
        produced = await asyncio.gather(*(one(sid) for sid in ids))
        wall = time.perf_counter() - t0
    return {"sessions": n_sessions, "requests": n_sessions * turns, "wall_s": round(wall, 3),
            "requests_per_s": round(n_sessions * turns / wall, 2), "tokens_per_s": round(sum(produced) / wall, 1)}


def overhead(tiny_target: str, tiny_speculator: str, quick: bool, out: Path) -> dict[str, Any]:
    engine = EngineConfig(target=tiny_target, speculator=tiny_speculator, n_ctx=4096)
    port = free_port()
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    n = 60 if quick else 200
    with server(specgate_cmd(port, engine, max_queue=256), port, logs / "specgate_tiny.log") as base:
        progress(f"overhead: {n} sequential requests")
        asyncio.run(overhead_requests(base, 5))  # warm-up
        values = asyncio.run(overhead_requests(base, n))
        routes = {}
        for route in ROUTES:
            progress(f"overhead: {n // 2} requests on {ROUTES[route][0]}")
            asyncio.run(overhead_requests(base, 3, route))
            per = asyncio.run(overhead_requests(base, n // 2, route))
            routes[route] = {"overhead_ms_p50": round(statistics.median(per), 2),
                             "overhead_ms_p99": round(percentile(per, 0.99), 2)}
        scaling = []
        for sessions in (1, 2, 4, 8):
            progress(f"overhead: {sessions} concurrent sessions")
            scaling.append(asyncio.run(concurrent_sessions(base, sessions, 4 if quick else 8)))
    summary = {"requests": n, "overhead_ms_p50": round(statistics.median(values), 2),
               "overhead_ms_p99": round(percentile(values, 0.99), 2),
               "overhead_ms_mean": round(statistics.fmean(values), 2), "routes": routes, "concurrency": scaling}
    write_result(out, "overhead", {"overhead_ms": values, "summary": summary},
                 {"target": tiny_target, "speculator": tiny_speculator})
    return summary
