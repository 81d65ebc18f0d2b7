"""Serving benchmarks over HTTP, one client for every server:

* ``multi_turn``: a scripted 6-turn agent session whose turns add tool results of
  500-3,000 tokens, against SpecGate with sessions, SpecGate stateless, and
  llama-cpp-python's own server (``llama_cpp.server``, prompt cache on) on the
  same target model.  TTFT is measured at the client: time to the first
  streamed content.
* ``overhead``: with tiny models, time spent outside the model per request
  (client wall time minus the server's model phases), and throughput with N
  concurrent sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import free_port, progress, write_result
from bench.textgen import WORDS_PER_TOKEN, filler
from core.config import EngineConfig

TOOL_TOKENS = [3000, 700, 2000, 500, 1500, 1000]
QUICK_TOOL_TOKENS = [1200, 500, 800]


@contextlib.contextmanager
def server(cmd: list[str], port: int, log: Path) -> Iterator[str]:
    base = f"http://127.0.0.1:{port}"
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.time() + 300
            while time.time() < deadline:
                if proc.poll() is not None:
                    raise RuntimeError(f"server exited: see {log}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/v1/models", timeout=2).status_code == 200:
                        break
                time.sleep(1)
            else:
                raise RuntimeError(f"server did not come up: see {log}")
            yield base
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(60)


def specgate_cmd(port: int, engine: EngineConfig, **extra: Any) -> list[str]:
    cmd = [sys.executable, "-m", "cli.main", "serve", "--port", str(port), "--target", engine.target,
           "--speculator", engine.speculator, "--n-ctx", str(engine.n_ctx), "--log-level", "warning"]
    for k, v in extra.items():
        cmd += [f"--{k.replace('_', '-')}", str(v)]
    return cmd


def llama_server_cmd(port: int, engine: EngineConfig, cache: bool) -> list[str]:
    """llama-cpp-python's server; it always reuses the live context's longest prefix,
    and ``--cache`` adds its RAM prompt cache of saved states on top."""
    threads = str(engine.n_threads)
    return [sys.executable, "-m", "llama_cpp.server", "--model", engine.target, "--n_ctx", str(engine.n_ctx),
            "--n_threads", threads, "--n_threads_batch", threads, "--flash_attn", "true",
            "--cache", str(cache).lower(), "--port", str(port), "--host", "127.0.0.1"]


def tool_turn(i: int, n_tokens: int, rng: random.Random) -> tuple[dict[str, str], str]:
    marker = f"M{rng.randint(10000, 99999)}"
    text = " ".join(filler(int(n_tokens * WORDS_PER_TOKEN), rng))
    half = len(text) // 2
    body = f"Tool result {i + 1} (log excerpt):\n{text[:half]} Marker for result {i + 1}: {marker}. {text[half:]}"
    return {"role": "user", "content": body + f"\nWhat is the marker for result {i + 1}? Reply briefly."}, marker


async def stream_turn(client: httpx.AsyncClient, messages: list[dict], session: str | None) -> dict[str, Any]:
    headers = {"X-Session-Id": session} if session else {}
    body = {"model": "bench", "messages": messages, "max_tokens": 16, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    ttft, text, timings = None, "", None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece and ttft is None:
                    ttft = time.perf_counter() - t0
                text += piece
            timings = chunk.get("timings", timings)
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0,
            "total_s": time.perf_counter() - t0, "answer": text, "timings": timings}


async def agent_session(base: str, sizes: list[int], use_session: bool, label: str,
                        rows: list[dict[str, Any]]) -> None:
    """Appends each turn's row to ``rows`` as it completes."""
    rng = random.Random(2026)
    async with httpx.AsyncClient(base_url=base, timeout=1800) as client:
        session = None
        if use_session:
            session = (await client.post("/v1/sessions", json={})).json()["id"]
        messages: list[dict] = [{"role": "system", "content": "You are an agent. Read tool results carefully."}]
        for i, n in enumerate(sizes):
            msg, marker = tool_turn(i, n, rng)
            messages.append(msg)
            progress(f"multi_turn[{label}] turn {i + 1}/{len(sizes)} (+{n} tokens)")
            r = await stream_turn(client, messages, session)
            messages.append({"role": "assistant", "content": r["answer"]})
            rows.append({"turn": i + 1, "tool_tokens": n, "correct": marker in r["answer"], **r})
            progress(f"  ttft {r['ttft_s']:.1f}s answer {r['answer'].strip()[:24]!r}")


ARMS = ("specgate_sessions", "specgate_stateless", "llama_cpp_server", "llama_cpp_server_cache")


def run_arm(arm: str, engine: EngineConfig, sizes: list[int], logs: Path) -> dict[str, Any]:
    """One arm; a server that dies mid-session is a result too (its turns so far and the error)."""
    port = free_port()
    if arm.startswith("specgate"):
        cmd, log = specgate_cmd(port, engine), logs / f"{arm}.log"
    else:
        cmd, log = llama_server_cmd(port, engine, cache=arm.endswith("_cache")), logs / f"{arm}.log"
    rows: list[dict[str, Any]] = []
    try:
        with server(cmd, port, log) as base:
            asyncio.run(agent_session(base, sizes, arm == "specgate_sessions", arm, rows))
        return {"rows": rows, "error": None}
    except (httpx.HTTPError, RuntimeError) as exc:
        progress(f"multi_turn[{arm}] failed after {len(rows)} turns: {exc!r}")
        return {"rows": rows, "error": f"{type(exc).__name__}: {exc}"}


def multi_turn(engine: EngineConfig, quick: bool, out: Path, arms: tuple[str, ...] = ARMS) -> dict[str, Any]:
    sizes = QUICK_TOOL_TOKENS if quick else TOOL_TOKENS
    n_ctx = 16384 if not quick else 8192
    engine = EngineConfig(target=engine.target, speculator=engine.speculator, n_ctx=n_ctx,
                          n_threads=engine.n_threads)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    if out.exists():  # re-running some arms keeps the others' results
        results = {k: v for k, v in orjson.loads(out.read_bytes()).get("arms", {}).items() if k in ARMS}
    for arm in arms:
        results[arm] = run_arm(arm, engine, sizes, logs)
        write_result(out, "multi_turn", {"tool_tokens": sizes, "n_ctx": n_ctx, "arms": results,
                                         "summary": summarize_arms(results, len(sizes))},
                     {"target": engine.target, "speculator": engine.speculator})
    return summarize_arms(results, len(sizes))


def summarize_arms(results: dict[str, dict[str, Any]], n_turns: int) -> dict[str, Any]:
    summary = {arm: {"total_ttft_s": round(sum(r["ttft_s"] for r in res["rows"]), 2),
                     "ttft_s": [round(r["ttft_s"], 2) for r in res["rows"]],
                     "correct": sum(r["correct"] for r in res["rows"]), "turns": len(res["rows"]),
                     "completed": len(res["rows"]) == n_turns and res["error"] is None, "error": res["error"]}
               for arm, res in results.items()}
    base = summary.get("llama_cpp_server")
    for s in summary.values():
        if base and base["completed"] and s["completed"]:
            s["speedup_vs_llama_cpp_server"] = round(base["total_ttft_s"] / s["total_ttft_s"], 3)
    return summary


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q * (len(ordered) - 1))))
    return ordered[k]


async def overhead_requests(base: str, n: int) -> list[float]:
    overheads = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for i in range(n):
            body = {"messages": [{"role": "user", "content": f"Say hello number {i}."}], "max_tokens": 4}
            t0 = time.perf_counter()
            r = (await client.post("/v1/chat/completions", json=body)).json()
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
                r = (await client.post("/v1/chat/completions", headers={"X-Session-Id": sid},
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
        scaling = []
        for sessions in (1, 2, 4, 8):
            progress(f"overhead: {sessions} concurrent sessions")
            scaling.append(asyncio.run(concurrent_sessions(base, sessions, 4 if quick else 8)))
    summary = {"requests": n, "overhead_ms_p50": round(statistics.median(values), 2),
               "overhead_ms_p99": round(percentile(values, 0.99), 2),
               "overhead_ms_mean": round(statistics.fmean(values), 2), "concurrency": scaling}
    write_result(out, "overhead", {"overhead_ms": values, "summary": summary},
                 {"target": tiny_target, "speculator": tiny_speculator})
    return summary
