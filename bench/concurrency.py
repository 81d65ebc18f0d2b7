"""``specgate bench concurrency``: many agent sessions at once.

Each session is an agent as the official ``openai`` client drives it: every
request streams with ``tools``, all sessions share one system prompt (the
framework's instructions), and each turn appends a question, the assistant's
``read_log`` call and the log it returned (a ``role: tool`` message).  For 1,
2, 4, ... sessions at once, against a fresh server per level:

* aggregate decode tokens/s: completion tokens over the time some session was
  decoding (the union of first-to-last-token windows), and over the wall time;
* p50/p95 TTFT over all turns;
* p95 inter-token latency (ITL) of the gaps during which another session was
  prefilling (between its request and its first token), next to the solo ITL;
* wall time, and the server's peak RSS (VmHWM).

Arms: SpecGate with resident slots and the step loop (``--slots N``); the same
without the prefix cache (``--prefix-min-tokens 0``); SpecGate serialized
(``--slots 1``: one turn at a time, as before the step loop);
``llama_cpp.server`` with the same ``n_threads`` (one request at a time); and
llama.cpp's own ``llama-server -np N`` (N slots, continuous batching, its RAM
prompt cache), built by ``ops/build_llama_server.sh``.
"""

from __future__ import annotations

import asyncio
import random
import re
import statistics
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import orjson

from bench.common import earlier_rows, free_port, progress, write_result
from bench.serving import llama_server_cmd, native_server_cmd, percentile, server, specgate_cmd
from bench.textgen import AGENT_TOOLS, WORDS_PER_TOKEN, filler
from core.config import EngineConfig

REUSE_KEYS = ("context_n", "cache_n", "kv_rebuilt", "prefix_shared_n", "prefix_built_n")
ARMS = ("specgate_slots", "specgate_noprefix", "specgate_serial", "llama_cpp_server", "llama_server")


def system_prompt(tokens: int) -> str:
    rng = random.Random(5)
    manual = " ".join(filler(int(tokens * WORDS_PER_TOKEN), rng))
    return "You are an operations agent. Use the tools; answer briefly.\nOperating manual:\n" + manual


def turns(session: int, n_turns: int, tool_tokens: int, null_ok: bool = True) -> list[list[dict[str, Any]]]:
    """``null_ok``: the assistant's tool-call message has ``content: null``, as the openai
    client sends it; llama_cpp.server refuses that (a 500), so it gets ``""``."""
    rng = random.Random(100 + session)
    out: list[list[dict[str, Any]]] = []
    for k in range(n_turns):
        svc = f"svc{session}-{k}"
        lines = filler(int(tool_tokens * WORDS_PER_TOKEN), rng)
        lines.insert(len(lines) // 2, f"ERROR {svc}: failure code E-{rng.randint(1000, 9999)}.")
        call = {"id": f"call_{k}", "type": "function",
                "function": {"name": "read_log", "arguments": orjson.dumps({"service": svc}).decode()}}
        out.append([{"role": "user", "content": f"Read the {svc} log and give its failure code."},
                    {"role": "assistant", "content": None if null_ok else "", "tool_calls": [call]},
                    {"role": "tool", "tool_call_id": call["id"], "content": "\n".join(lines)}])
    return out


async def stream_turn(client: Any, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """One streamed request with the agent tools: when it was sent, when each token came,
    the text, and the reuse figures of SpecGate's timings (None from other servers)."""
    sent = time.perf_counter()
    arrivals: list[float] = []
    text, timings = "", None
    stream = await client.chat.completions.create(model="bench", messages=messages, tools=AGENT_TOOLS,
                                                  max_tokens=max_tokens, temperature=0, stream=True)
    async for chunk in stream:
        timings = (chunk.model_extra or {}).get("timings", timings)  # SpecGate's, on its last chunk
        for choice in chunk.choices:
            piece = choice.delta.content or ""
            if piece or choice.delta.tool_calls:
                arrivals.append(time.perf_counter())
            text += piece
    return {"sent": sent, "arrivals": arrivals, "ttft_s": (arrivals[0] - sent) if arrivals else None,
            "answer": text, **{key: (timings or {}).get(key) for key in REUSE_KEYS}}


def agent_client(base: str, label: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=7200,
                              default_headers={"X-SpecGate-Session": label})


async def one_session(base: str, label: str, system: str, script: list[list[dict[str, Any]]], max_tokens: int,
                      rows: list[dict[str, Any]], start: asyncio.Event | None = None) -> None:
    if start is not None:
        await start.wait()
    async with agent_client(base, label) as client:
        messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
        for k, append in enumerate(script):
            messages += append
            row = await stream_turn(client, messages, max_tokens)
            rows.append({"session": label, "turn": k + 1, **row})
            messages.append({"role": "assistant", "content": row["answer"] or ""})


def union_s(windows: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(windows):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def itl_during_prefill(rows: list[dict[str, Any]]) -> tuple[list[float], list[float]]:
    """All inter-token gaps, and those overlapping another session's prefill window."""
    prefills = [(r["session"], r["sent"], r["arrivals"][0]) for r in rows if r["arrivals"]]
    gaps, during = [], []
    for r in rows:
        for a, b in zip(r["arrivals"], r["arrivals"][1:], strict=False):
            gaps.append(b - a)
            if any(s != r["session"] and p0 < b and a < p1 for s, p0, p1 in prefills):
                during.append(b - a)
    return gaps, during


def kv_reuse(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """From SpecGate's timings (None for a server that reports none): sessions whose KV was
    dropped and rebuilt, later turns that re-prefilled their whole history, and first
    turns that started from another session's cached system prompt."""
    if not any(r.get("context_n") for r in rows):
        return {"kv_rebuilds": None, "full_reprefills": None, "prefix_hits": None}
    later = [r for r in rows if r["turn"] > 1 and r.get("context_n")]
    first = [r for r in rows if r["turn"] == 1 and r.get("context_n")]
    return {"kv_rebuilds": sum(bool(r.get("kv_rebuilt")) for r in rows),
            "full_reprefills": sum(not r.get("cache_n") for r in later),
            "prefix_hits": sum(bool(r.get("prefix_shared_n")) for r in first)}


def quoted_codes(rows: list[dict[str, Any]], params: dict[str, Any]) -> dict[str, int]:
    """Answers that quote their own turn's planted failure code, and answers that quote a code
    planted only in another session's tool results: under batching that would be a leak."""
    def index(r: dict[str, Any]) -> int:  # labels are arm-sessions-index (see _level)
        return int(r["session"].rsplit("-", 1)[1])

    codes = {i: [re.findall(r"E-\d{4}", t[2]["content"])[0]
                 for t in turns(i, params["turns"], params["tool_tokens"])] for i in map(index, rows)}
    every = {c for mine in codes.values() for c in mine}
    own = foreign = 0
    for r in rows:
        quoted = set(re.findall(r"E-\d{4}", r.get("answer") or ""))
        own += codes[index(r)][r["turn"] - 1] in quoted
        foreign += bool(quoted & (every - set(codes[index(r)])))
    return {"answers_own_code": own, "answers_foreign_code": foreign}


def peak_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        return None
    return None


def level(arm: str, n: int, engine: EngineConfig, params: dict[str, Any], logs: Path) -> dict[str, Any]:
    """One arm at one concurrency; a server that fails mid-run is a result too."""
    import openai

    try:
        return _level(arm, n, engine, params, logs)
    except (openai.APIError, RuntimeError) as exc:
        progress(f"concurrency[{arm}] {n} sessions failed: {exc!r}"[:300])
        return {"arm": arm, "sessions": n, "error": f"{type(exc).__name__}: {exc}"[:500]}


def _level(arm: str, n: int, engine: EngineConfig, params: dict[str, Any], logs: Path) -> dict[str, Any]:
    port, pids = free_port(), list[int]()
    slots = {"specgate_slots": max(n, 1), "specgate_noprefix": max(n, 1), "specgate_serial": 1}.get(arm)
    if slots:
        cmd = specgate_cmd(port, engine, slots=slots, n_threads=engine.n_threads, max_queue=256,
                           prefix_min_tokens=0 if arm == "specgate_noprefix" else 256)
    elif arm == "llama_server":
        cmd = native_server_cmd(port, engine, max(n, 1))
    else:
        cmd = llama_server_cmd(port, engine, cache=False)
    system = system_prompt(params["system_tokens"])
    rows: list[dict[str, Any]] = []
    with server(cmd, port, logs / f"concurrency_{arm}_{n}.log", pids) as base:
        progress(f"concurrency[{arm}] {n} sessions")

        async def all_sessions() -> None:
            # staggered: one agent runs its whole session first, then the others start together
            # (and may start from its KV for the system prompt they share)
            lead_done = asyncio.Event() if params.get("stagger") else None

            def agent(i: int, start: asyncio.Event | None = None) -> Coroutine[Any, Any, None]:
                script = turns(i, params["turns"], params["tool_tokens"], null_ok=arm != "llama_cpp_server")
                return one_session(base, f"{arm}-{n}-{i}", system, script, params["max_tokens"], rows, start)

            async def lead() -> None:
                await agent(0)
                if lead_done is not None:
                    lead_done.set()

            await asyncio.gather(lead(), *(agent(i, lead_done) for i in range(1, n)))

        t0 = time.perf_counter()
        asyncio.run(all_sessions())
        wall = time.perf_counter() - t0
        rss = peak_rss_mb(pids[0])
    tokens = sum(len(r["arrivals"]) for r in rows)
    decoding = union_s([(r["arrivals"][0], r["arrivals"][-1]) for r in rows if len(r["arrivals"]) > 1])
    ttfts = [r["ttft_s"] for r in rows if r["ttft_s"] is not None]
    gaps, during = itl_during_prefill(rows)
    return {"arm": arm, "sessions": n, "turns": len(rows), "wall_s": round(wall, 1), "tokens": tokens,
            "decode_tok_s": round(tokens / decoding, 2) if decoding else None,
            "tok_s_wall": round(tokens / wall, 3),
            "ttft_p50_s": round(statistics.median(ttfts), 2), "ttft_p95_s": round(percentile(ttfts, 0.95), 2),
            "itl_p50_s": round(statistics.median(gaps), 3) if gaps else None,
            "itl_p95_s": round(percentile(gaps, 0.95), 3) if gaps else None,
            "itl_p95_during_prefill_s": round(percentile(during, 0.95), 3) if during else None,
            "n_itl_during_prefill": len(during), "peak_rss_mb": rss, **kv_reuse(rows),
            **quoted_codes(rows, params),
            "rows": [{k: v for k, v in r.items() if k != "arrivals"} | {"n_tokens": len(r["arrivals"])}
                     for r in rows]}


def run(engine: EngineConfig, quick: bool, out: Path, arms: tuple[str, ...] = ARMS,
        levels: tuple[int, ...] | None = None, stagger: bool = False) -> list[dict[str, Any]]:
    params: dict[str, Any] = ({"system_tokens": 1000, "turns": 3, "tool_tokens": 300, "max_tokens": 32} if quick else
                              {"system_tokens": 1500, "turns": 6, "tool_tokens": 850, "max_tokens": 64})
    if stagger:
        params["stagger"] = True
    levels = levels or ((1, 2, 4) if quick else (1, 2, 4, 8, 12))
    engine = EngineConfig(target=engine.target, speculator=engine.speculator, scorer=engine.scorer,
                          n_threads=engine.n_threads,
                          n_ctx=4096 if quick else 8192)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    kept = earlier_rows(out, params, "levels", lambda r: r["arm"] in arms and r["sessions"] in levels)
    results: list[dict[str, Any]] = []
    for n in levels:
        for arm in arms:
            results.append(level(arm, n, engine, params, logs))
            r = results[-1]
            if "error" in r:
                continue
            progress(f"  wall {r['wall_s']}s decode {r['decode_tok_s']} tok/s ttft p50 {r['ttft_p50_s']}s "
                     f"itl p95 {r['itl_p95_s']}s (during prefill {r['itl_p95_during_prefill_s']}s) "
                     f"rss {r['peak_rss_mb']} MB")
            merged = sorted(kept + results, key=lambda r: (r["sessions"], ARMS.index(r["arm"])))
            write_result(out, "concurrency", {"params": params, "levels": merged},
                         {"target": engine.target, "speculator": engine.speculator})
    return sorted(kept + results, key=lambda r: (r["sessions"], ARMS.index(r["arm"])))
