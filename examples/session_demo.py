"""A scripted 6-turn agent session against a running gateway, over HTTP or WebSocket.

    specgate serve &                       # the Qwen pair at default policy
    python -m examples.session_demo --transport http --out results/sessions/http.json
    python -m examples.session_demo --transport ws   --out results/sessions/ws.json

Each turn is agent-shaped, as the openai client sends it: a question, the
assistant's ``read_log`` call and the log it returned as a ``role: tool``
message (sizes alternate long/short, so some deltas cross min_tokens and some
do not), with the tools offered on every request.  Over HTTP the session is
named by ``X-SpecGate-Session`` alone (created on first use).  The script prints and
stores every turn's timings.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from pathlib import Path

import aiohttp
import httpx
import orjson

from bench.textgen import AGENT_TOOLS, filler

WORDS = [1150, 220, 900, 160, 850, 120]  # ~1.3 tokens per word
FIELDS = ("specprefill", "context_n", "speculator_prefill_n", "speculator_cache_n", "prompt_n", "cache_n",
          "scoring_ms", "prompt_ms", "ttft_ms", "predicted_n")


def turn_messages(i: int, rng: random.Random) -> list[dict]:
    code = f"R{rng.randint(1000, 9999)}"
    text = " ".join(filler(WORDS[i], rng))
    call = {"id": f"call_{i}", "type": "function",
            "function": {"name": "read_log", "arguments": orjson.dumps({"service": f"svc-{i}"}).decode()}}
    return [{"role": "user", "content": f"What is the record marker in the svc-{i} log? Reply briefly."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"],
             "content": f"{text}\nRecord marker for svc-{i}: {code}.\n"}]


def show(i: int, t: dict, answer: str) -> None:
    cols = " ".join(f"{k}={t[k]}" for k in FIELDS)
    print(f"turn {i + 1}: {cols} | {answer.strip()[:60]!r}", flush=True)


async def run_http(base: str, n_turns: int, max_tokens: int) -> list[dict]:
    rng = random.Random(11)
    rows = []
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        sid = f"demo-{rng.randint(0, 10**9)}"  # created by the first request that names it
        messages = [{"role": "system", "content": "You are an agent reading tool results."}]
        for i in range(n_turns):
            messages += turn_messages(i, rng)
            t0 = time.perf_counter()
            r = await client.post("/v1/chat/completions", headers={"X-SpecGate-Session": sid},
                                  json={"messages": messages, "tools": AGENT_TOOLS, "max_tokens": max_tokens})
            r.raise_for_status()
            body = r.json()
            reply = body["choices"][0]["message"]
            messages.append(reply)
            rows.append({"turn": i + 1, "wall_s": round(time.perf_counter() - t0, 2), "answer": reply["content"] or "",
                         **{k: body["timings"][k] for k in FIELDS}})
            show(i, body["timings"], reply["content"] or "")
    return rows


async def run_ws(base: str, n_turns: int, max_tokens: int) -> list[dict]:
    rng = random.Random(11)
    rows = []
    async with aiohttp.ClientSession() as http:
        async with http.post(base + "/v1/sessions", json={}) as r:
            sid = (await r.json())["id"]
        async with http.ws_connect(f"{base}/v1/sessions/{sid}/ws", timeout=aiohttp.ClientWSTimeout(ws_close=600)) as ws:
            new = [{"role": "system", "content": "You are an agent reading tool results."}]
            for i in range(n_turns):
                new += turn_messages(i, rng)
                t0 = time.perf_counter()
                await ws.send_json({"type": "turn", "messages": new, "tools": AGENT_TOOLS, "max_tokens": max_tokens})
                new = []
                while (event := await ws.receive_json(timeout=600))["type"] == "delta":
                    pass
                if event["type"] != "done":
                    raise RuntimeError(event)
                answer = event["message"]["content"] or ""
                rows.append({"turn": i + 1, "wall_s": round(time.perf_counter() - t0, 2), "answer": answer,
                             **{k: event["timings"][k] for k in FIELDS}})
                show(i, event["timings"], answer)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--transport", choices=("http", "ws"), default="http")
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--out")
    a = ap.parse_args()
    runner = run_http if a.transport == "http" else run_ws
    rows = asyncio.run(runner(a.base, a.turns, a.max_tokens))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_bytes(orjson.dumps({"transport": a.transport, "turns": rows}, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
