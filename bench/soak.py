"""``specgate bench soak``: many sessions, many turns, a small KV budget, on tiny models.

100 sessions x 10 turns by default, 8 at a time, through a real ``specgate serve``
with a real redis-server, a RAM budget far below the sessions' KV and a capped
spill directory, so parking, spilling, dropping and rebuilding all happen.  It
samples the server's RSS, parked KV bytes (RAM and disk) and the store's
pending writes once a second, counts errors, and at the end checks that every
session's stored history is exactly what its client sent and received.

``--responses``: the clients speak the Responses API instead, storing every response
(``store: true``, chained by ``previous_response_id``, with 30 tool definitions each), while
two more clients flood ``/v1/messages/count_tokens`` with 20 KB bodies; Redis's own memory
is sampled beside the server's RSS.  Both must stay flat: stored bodies are capped per
conversation, and counts past the queue bound get a 429 instead of piling up.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import free_port, progress, write_result
from bench.serving import redis_server, rss_mb, server, specgate_cmd
from core.config import EngineConfig

WORDS = ("valve pump sensor log line reading pressure flow alarm reset shift operator panel unit check "
         "cycle status north south east west level drift").split()


def scrape(base: str) -> dict[str, float]:
    text = httpx.get(base + "/metrics", timeout=5).text
    wanted = ("specgate_kv_bytes_ram", "specgate_kv_bytes_disk", "specgate_store_pending_writes",
              "specgate_live_sessions", "specgate_kv_rebuilds_total", "specgate_spill_writes_total",
              "specgate_implicit_sessions", "specgate_implicit_hits_total", "specgate_implicit_misses_total")
    out = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in wanted:
            out[name] = float(value)
    return out


def sampler(pid: int, base: str, samples: list[dict[str, Any]], stop: threading.Event, rport: int) -> None:
    import redis

    store = redis.Redis(port=rport)
    t0 = time.time()
    while not stop.wait(1.0):
        with contextlib.suppress(Exception):
            samples.append({"t_s": round(time.time() - t0, 1), "rss_mb": round(rss_mb(pid), 1),
                            "redis_mb": round(store.info("memory")["used_memory"] / 2**20, 2), **scrape(base)})


def text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


async def session(http: httpx.AsyncClient, sid: str, turns: int, gate: asyncio.Semaphore,
                  errors: list[str], stateless: bool = False) -> list[dict[str, Any]]:
    """``stateless``: the client names no session and resends the history, as frameworks do."""
    rng = random.Random(sid)
    history: list[dict[str, Any]] = [{"role": "system", "content": "You keep plant logs."}]
    for turn in range(turns):
        history.append({"role": "user", "content": f"Turn {turn}: " + text(rng, 40)})
        async with gate:
            r = await http.post("/v1/chat/completions", headers={} if stateless else {"X-SpecGate-Session": sid},
                                json={"messages": history, "max_tokens": 6})
        if r.status_code != 200:
            errors.append(f"{sid} turn {turn}: {r.status_code} {r.text[:200]}")
            history.pop()
            continue
        history.append(r.json()["choices"][0]["message"])
    return history


TOOLS = [{"type": "function", "name": f"tool_{i}", "description": "A plant tool. " * 10,
          "parameters": {"type": "object", "properties": {"unit": {"type": "string"}}}} for i in range(30)]


async def responses_chain(http: httpx.AsyncClient, sid: str, turns: int, gate: asyncio.Semaphore,
                          errors: list[str]) -> list[dict[str, Any]]:
    """A stored conversation: every response kept, each turn continuing the last by its id."""
    rng = random.Random(sid)
    previous: str | None = None
    for turn in range(turns):
        async with gate:
            r = await http.post("/v1/responses", json={
                "instructions": "You keep plant logs.", "input": f"Turn {turn}: " + text(rng, 40), "tools": TOOLS,
                "max_output_tokens": 6, **({"previous_response_id": previous} if previous else {})})
        if r.status_code != 200:
            errors.append(f"{sid} turn {turn}: {r.status_code} {r.text[:200]}")
            continue
        previous = r.json()["id"]
    return []


async def count_flood(http: httpx.AsyncClient, done: asyncio.Event, tally: dict[str, int]) -> None:
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "valve " * 3400}]}
    while not done.is_set():
        r = await http.post("/v1/messages/count_tokens", json=body)
        key = str(r.status_code)
        tally[key] = tally.get(key, 0) + 1
        if r.status_code == 429:
            await asyncio.sleep(0.05)


async def drive(base: str, n_sessions: int, turns: int, concurrency: int, stateless: bool = False,
                responses: bool = False) -> tuple[dict[str, list], list[str], dict[str, int]]:
    gate = asyncio.Semaphore(concurrency)
    errors: list[str] = []
    tally: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=base, timeout=300) as http:
        ids = [f"soak-{i:03d}" for i in range(n_sessions)]
        done = asyncio.Event()
        floods = [asyncio.create_task(count_flood(http, done, tally)) for _ in range(2 if responses else 0)]
        client = (lambda sid: responses_chain(http, sid, turns, gate, errors)) if responses else \
            (lambda sid: session(http, sid, turns, gate, errors, stateless))
        histories = await asyncio.gather(*(client(sid) for sid in ids))
        done.set()
        await asyncio.gather(*floods)
    return dict(zip(ids, histories, strict=True)), errors, tally


def run(tiny_target: str, tiny_speculator: str, out: Path, n_sessions: int = 100, turns: int = 10,
        stateless: bool = False, responses: bool = False) -> dict[str, Any]:
    import redis

    port = free_port()
    spill = Path(tempfile.mkdtemp(prefix="specgate-soak-"))
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engine = EngineConfig(target=tiny_target, speculator=tiny_speculator, n_ctx=8192)
    samples: list[dict[str, Any]] = []
    pids: list[int] = []
    stop = threading.Event()
    name = "soak_responses" if responses else "soak_stateless" if stateless else "soak"
    try:
        with redis_server() as rport, server(
                specgate_cmd(port, engine, redis_url=f"redis://127.0.0.1:{rport}/0", kv_budget_mb=16,
                             kv_spill_dir=str(spill), kv_spill_max_mb=64, max_queue=256, min_tokens=0),
                port, logs / f"{name}.log", pids) as base:
            th = threading.Thread(target=sampler, args=(pids[0], base, samples, stop, rport), daemon=True)
            th.start()
            progress(f"soak: {n_sessions} sessions x {turns} turns")
            t0 = time.perf_counter()
            histories, errors, counts = asyncio.run(drive(base, n_sessions, turns, 8, stateless, responses))
            wall = time.perf_counter() - t0
            time.sleep(2)  # let the store writer land the last records
            stop.set()
            th.join()
            client = redis.Redis(port=rport)
            # a named session's record is checked against its client's history; an implicit
            # one's id is the server's, so stateless runs check every reply's record instead
            intact = sum(orjson.loads(client.get(f"specgate:session:anonymous:{sid}") or b"{}").get("history")
                         == h for sid, h in histories.items()) if not (stateless or responses) else None
            final = scrape(base)
    finally:
        stop.set()
        shutil.rmtree(spill, ignore_errors=True)
    rss = [s["rss_mb"] for s in samples]
    third = max(1, len(rss) // 3)
    redis_mb = [s["redis_mb"] for s in samples]
    summary = {"stateless": stateless, "responses": responses, "count_tokens": counts,
               "redis_mb_mean_first_third": round(sum(redis_mb[:third]) / third, 2) if redis_mb else None,
               "redis_mb_mean_last_third": round(sum(redis_mb[-third:]) / third, 2) if redis_mb else None,
               "redis_mb_max": max(redis_mb, default=None), "sessions": n_sessions, "turns": turns,
               "requests": n_sessions * turns,
               "wall_s": round(wall, 1),
               "errors": len(errors), "histories_intact": intact, "rss_mb_start": rss[0] if rss else None,
               "rss_mb_max": max(rss, default=None), "rss_mb_end": rss[-1] if rss else None,
               "rss_mb_mean_first_third": round(sum(rss[:third]) / third, 1) if rss else None,
               "rss_mb_mean_last_third": round(sum(rss[-third:]) / third, 1) if rss else None,
               "final_metrics": final, "kv_budget_mb": 16, "spill_max_mb": 64}
    write_result(out, "soak", {"summary": summary, "samples": samples, "errors": errors[:50]},
                 {"target": tiny_target, "speculator": tiny_speculator})
    return summary
