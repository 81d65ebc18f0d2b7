"""``specgate bench long_prefill``: do agents keep streaming while another prefills 8K tokens?

Agent-shaped traffic throughout (official ``openai`` client, streaming, ``tools``
on every request, ``X-SpecGate-Session``).  Per arm, on a fresh server:

1. one *streamer* session runs a turn alone: its inter-token latency (ITL) is the
   solo figure;
2. the other streamers join; every streamer loops over turns (a short
   ``role: tool`` result, ``max_tokens`` out) until the long session has its
   first token;
3. after ``warmup_s``, the *long* session sends its first turn: the system prompt,
   a question, the assistant's ``read_log`` call and a ``role: tool`` log of
   ``long_tokens`` tokens.

Reported: the streamers' p50/p95 ITL alone, before the long turn and while it
prefills (gaps overlapping its request-to-first-token window), the streamers'
turn TTFTs in that window, and the long turn's TTFT.  A long turn that has no
first token after ``max_s`` counts as starved.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import earlier_rows, free_port, progress, write_result
from bench.concurrency import agent_client, peak_rss_mb, stream_turn, system_prompt, turns
from bench.serving import llama_server_cmd, native_server_cmd, percentile, server, specgate_cmd
from bench.textgen import WORDS_PER_TOKEN, filler
from core.config import EngineConfig

ARMS = ("specgate", "specgate_decode_first", "llama_server", "llama_cpp_server")


def long_turn(tokens: int, null_ok: bool = True) -> list[dict[str, Any]]:
    rng = random.Random(77)
    lines = filler(int(tokens * WORDS_PER_TOKEN), rng)
    lines.insert(len(lines) // 2, "ERROR billing: failure code E-4242.")
    call = {"id": "call_long", "type": "function",
            "function": {"name": "read_log", "arguments": orjson.dumps({"service": "billing"}).decode()}}
    return [{"role": "user", "content": "Read the billing log and give its failure code."},
            {"role": "assistant", "content": None if null_ok else "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "\n".join(lines)}]


def stats(gaps: list[float]) -> dict[str, float | None]:
    return {"p50_s": round(statistics.median(gaps), 3) if gaps else None,
            "p95_s": round(percentile(gaps, 0.95), 3) if gaps else None, "n": len(gaps)}


def gaps_in(rows: list[dict[str, Any]], lo: float, hi: float) -> list[float]:
    """Inter-token gaps of ``rows`` that overlap the window (lo, hi)."""
    return [b - a for r in rows for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False) if a < hi and b > lo]


async def streamer(base: str, label: str, system: str, params: dict[str, Any], rows: list[dict[str, Any]],
                   go: asyncio.Event, stop: asyncio.Event, first: asyncio.Event | None = None) -> None:
    """Turn after turn until ``stop``; after ``session_turns`` turns the agent starts a new
    session (``label_1``, ``label_2``, ...), so its history stays inside the context."""
    await go.wait()
    generation = 0
    while not stop.is_set():
        script = turns(int(label.rsplit("-", 1)[1]) + 10 * generation, params["session_turns"],
                       params["tool_tokens"], null_ok=params["null_ok"])  # new logs for a new session
        async with agent_client(base, f"{label}_{generation}") as client:
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
            for k, append in enumerate(script):
                if stop.is_set():
                    break
                messages += append
                row = await stream_turn(client, messages, params["max_tokens"])
                rows.append({"session": label, "turn": k + 1, **row})
                messages.append({"role": "assistant", "content": row["answer"] or ""})
                if first is not None:
                    first.set()
        generation += 1


async def scenario(base: str, params: dict[str, Any]) -> dict[str, Any]:
    system = system_prompt(params["system_tokens"])
    rows: list[dict[str, Any]] = []
    go_solo, go_all, stop, solo_done = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()
    n = params["streamers"]
    tasks = [asyncio.create_task(streamer(base, "stream-0", system, params, rows, go_solo, stop, solo_done))]
    tasks += [asyncio.create_task(streamer(base, f"stream-{i}", system, params, rows, go_all, stop))
              for i in range(1, n)]
    go_solo.set()
    solo_wait = asyncio.create_task(solo_done.wait())
    await asyncio.wait([solo_wait, tasks[0]], return_when=asyncio.FIRST_COMPLETED)
    if not solo_done.is_set():  # the first streamer failed before its first turn ended
        solo_wait.cancel()
        stop.set()
        await asyncio.gather(*tasks)  # raises its error
    solo_end = time.perf_counter()
    go_all.set()
    await asyncio.sleep(params["warmup_s"])
    long: dict[str, Any] = {}
    async with agent_client(base, "long") as client:
        messages = [{"role": "system", "content": system}, *long_turn(params["long_tokens"], params["null_ok"])]
        try:
            long = await asyncio.wait_for(stream_turn(client, messages, params["max_tokens"]), params["max_s"])
        except TimeoutError:
            long = {"sent": time.perf_counter() - params["max_s"], "arrivals": [], "ttft_s": None, "starved": True}
    stop.set()
    await asyncio.gather(*tasks)
    sent = long["sent"]
    until = long["arrivals"][0] if long["arrivals"] else sent + params["max_s"]
    solo = [r for r in rows if r["arrivals"] and r["arrivals"][-1] <= solo_end]
    before = [r for r in rows if r["sent"] >= solo_end]
    during_turns = [r["ttft_s"] for r in rows if r["ttft_s"] is not None and sent < r["sent"] + r["ttft_s"] < until]
    return {"long_ttft_s": round(long["ttft_s"], 1) if long["ttft_s"] else None,
            "long_starved": bool(long.get("starved")), "long_context_n": long.get("context_n"),
            "long_answer": long.get("answer", "")[:200],
            "itl_solo": stats(gaps_in(solo, 0, solo_end)),
            "itl_before": stats(gaps_in(before, solo_end, sent)),
            "itl_during_long_prefill": stats(gaps_in(rows, sent, until)),
            "streamer_ttft_during_long_prefill": stats(during_turns),
            "streamer_turns": len(rows)}


def run_arm(arm: str, engine: EngineConfig, params: dict[str, Any], logs: Path) -> dict[str, Any]:
    import openai

    port, pids, slots = free_port(), list[int](), params["streamers"] + 1
    if arm.startswith("specgate"):
        cmd = specgate_cmd(port, engine, slots=slots, n_threads=engine.n_threads,
                           **({"step_tokens": 0} if arm == "specgate_decode_first" else {}))
    elif arm == "llama_server":
        cmd = native_server_cmd(port, engine, slots)
    else:
        cmd = llama_server_cmd(port, engine, cache=False)
    params = {**params, "null_ok": arm != "llama_cpp_server"}
    try:
        with server(cmd, port, logs / f"long_prefill_{arm}.log", pids) as base:
            progress(f"long_prefill[{arm}]")
            t0 = time.perf_counter()
            result = asyncio.run(scenario(base, params))
            rss = peak_rss_mb(pids[0])
    except (openai.APIError, RuntimeError) as exc:  # a server that fails mid-run is a result too
        return {"arm": arm, "error": f"{type(exc).__name__}: {exc}"[:300]}
    return {"arm": arm, "wall_s": round(time.perf_counter() - t0, 1), "peak_rss_mb": rss, **result}


def run(engine: EngineConfig, quick: bool, out: Path, arms: tuple[str, ...] = ARMS) -> list[dict[str, Any]]:
    params: dict[str, Any] = {"streamers": 3, "system_tokens": 400, "tool_tokens": 100, "max_tokens": 48,
                              "long_tokens": 2000 if quick else 8000, "warmup_s": 15,
                              "max_s": 900, "session_turns": 10}
    engine = EngineConfig(target=engine.target, speculator=engine.speculator, scorer=engine.scorer,
                          n_threads=engine.n_threads,
                          n_ctx=(params["long_tokens"] + 2048))
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results = earlier_rows(out, params, "arms", lambda r: r["arm"] in arms)
    for arm in arms:
        results.append(run_arm(arm, engine, params, logs))
        progress(f"  {orjson.dumps(results[-1]).decode()[:400]}")
        results.sort(key=lambda r: ARMS.index(r["arm"]))
        write_result(out, "long_prefill", {"params": params, "arms": results},
                     {"target": engine.target, "speculator": engine.speculator})
    return results
