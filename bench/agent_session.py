"""``specgate bench multi_turn``: an agent session as agent frameworks send it.

The official ``openai`` client streams every request with ``tools``; each long
turn is a user question, the assistant's ``read_log`` call and the long log it
returned (a ``role: tool`` message with one planted error code); the last turn
asks for an action the model must take with a tool call.  Arms, each a fresh
server on the same target: SpecGate sessions dense (SpecPrefill off), with the
``skip`` guard, with the ``structural`` guard (the default), and
``llama_cpp.server`` with the same messages.

Per turn it records the client's TTFT (first streamed content or tool-call
delta; SpecGate holds back text that may be a call, so for a reply that opens
like JSON this is later than the server's), the server's ``timings`` where
there are some, whether the long turns' answers hold the planted code, and
whether the final call is valid: it parses, names an offered tool, and its
arguments satisfy that tool's schema.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import free_port, progress, write_result
from bench.serving import llama_server_cmd, server, specgate_cmd
from bench.textgen import AGENT_TOOLS, WORDS_PER_TOKEN, filler
from core.config import EngineConfig

ARMS = ("specgate_dense", "specgate_skip", "specgate_structural", "llama_cpp_server", "specgate_structural_forced")
LONG_TOKENS = (3500, 3500)
QUICK_LONG_TOKENS = (1200, 900)
SERVICES = ("billing", "payments", "search", "mailer")
FLAGS = {"specgate_dense": {"enabled": "false"}, "specgate_skip": {"guard_mode": "skip"},
         "specgate_structural": {"guard_mode": "structural"},
         # break-even off: would scoring every long turn (turn 2 included) have paid?
         "specgate_structural_forced": {"guard_mode": "structural", "break_even": "false"}}


def script(sizes: tuple[int, ...], seed: int = 11) -> list[dict[str, Any]]:
    """The session's turns: what the client appends before each request, and what to check."""
    rng = random.Random(seed)
    turns: list[dict[str, Any]] = []
    for i, n in enumerate(sizes):
        svc, code = SERVICES[i], f"E-{rng.randint(1000, 9999)}"
        lines = filler(int(n * WORDS_PER_TOKEN), rng)
        lines.insert(int(len(lines) * rng.uniform(0.3, 0.7)), f"ERROR {svc}: failure code {code}, see runbook.")
        call = {"id": f"call_{i}", "type": "function",
                "function": {"name": "read_log", "arguments": orjson.dumps({"service": svc}).decode()}}
        turns.append({"kind": "long", "expect": code, "append": [
            {"role": "user", "content": f"Read the {svc} log and tell me its failure code. Reply with the code."},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": call["id"], "content": "\n".join(lines)}]})
    turns.append({"kind": "call", "expect": SERVICES[0], "append": [
        {"role": "user", "content": f"The {SERVICES[0]} service is failing. Restart it now."}]})
    return turns


def check_call(calls: list[dict[str, Any]], expect: str) -> dict[str, Any]:
    import jsonschema

    if not calls:
        return {"valid_call": False, "right_call": False, "why": "no tool call"}
    schemas: dict[str, Any] = {t["function"]["name"]: t["function"]["parameters"] for t in AGENT_TOOLS}
    name, raw = calls[0]["name"], calls[0]["arguments"]
    try:
        args = orjson.loads(raw)
        jsonschema.validate(args, schemas[name])
    except (orjson.JSONDecodeError, KeyError, jsonschema.ValidationError) as exc:
        return {"valid_call": False, "right_call": False, "why": f"{type(exc).__name__}: {exc}"[:200]}
    return {"valid_call": True, "right_call": name == "restart_service" and args.get("service") == expect}


async def request(client: Any, messages: list[dict[str, Any]]) -> dict[str, Any]:
    t0 = time.perf_counter()
    ttft, text, timings = None, "", None
    calls: dict[int, dict[str, str]] = {}
    stream = await client.chat.completions.create(model="bench", messages=messages, tools=AGENT_TOOLS,
                                                  max_tokens=24, temperature=0, stream=True)
    async for chunk in stream:
        timings = (chunk.model_extra or {}).get("timings", timings)
        for choice in chunk.choices:
            delta = choice.delta
            if (delta.content or delta.tool_calls) and ttft is None:
                ttft = time.perf_counter() - t0
            text += delta.content or ""
            for tc in delta.tool_calls or ():
                slot = calls.setdefault(tc.index, {"name": "", "arguments": ""})
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return {"ttft_s": ttft if ttft is not None else time.perf_counter() - t0, "total_s": time.perf_counter() - t0,
            "answer": text, "tool_calls": [calls[k] for k in sorted(calls)], "timings": timings}


async def session(base: str, turns: list[dict[str, Any]], label: str, rows: list[dict[str, Any]]) -> None:
    import openai

    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="bench", max_retries=0, timeout=3600,
                                  default_headers={"X-SpecGate-Session": f"bench-{label}"}) as client:
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": "You are an operations agent. Use the tools; answer briefly."}]
        for i, turn in enumerate(turns):
            messages += turn["append"]
            progress(f"agent[{label}] turn {i + 1}/{len(turns)} ({turn['kind']})")
            r = await request(client, messages)
            row = {"turn": i + 1, "kind": turn["kind"], **r}
            if turn["kind"] == "long":
                row["correct"] = turn["expect"] in r["answer"]
            else:
                row.update(check_call(r["tool_calls"], turn["expect"]))
            rows.append(row)
            reply: dict[str, Any] = {"role": "assistant", "content": r["answer"] or None}
            if r["tool_calls"]:
                reply["tool_calls"] = [{"id": f"call_r{i}_{k}", "type": "function", "function": c}
                                       for k, c in enumerate(r["tool_calls"])]
            messages.append(reply if reply["content"] or r["tool_calls"] else {"role": "assistant", "content": ""})
            status = (r["timings"] or {}).get("specprefill", "-")
            progress(f"  ttft {r['ttft_s']:.1f}s status {status} answer {r['answer'].strip()[:24]!r} "
                     f"calls {r['tool_calls']}")


def run_arm(arm: str, engine: EngineConfig, turns: list[dict[str, Any]], logs: Path) -> dict[str, Any]:
    """One arm; a server that dies or refuses mid-session is a result too."""
    import openai

    port = free_port()
    cmd = (specgate_cmd(port, engine, **FLAGS[arm]) if arm in FLAGS
           else llama_server_cmd(port, engine, cache=False))
    rows: list[dict[str, Any]] = []
    try:
        with server(cmd, port, logs / f"agent_{arm}.log") as base:
            asyncio.run(session(base, turns, arm, rows))
        return {"rows": rows, "error": None}
    except (openai.APIError, RuntimeError) as exc:
        progress(f"agent[{arm}] failed after {len(rows)} turns: {exc!r}")
        return {"rows": rows, "error": f"{type(exc).__name__}: {exc}"[:500]}


def summarize(results: dict[str, dict[str, Any]], n_turns: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm, res in results.items():
        long = [r for r in res["rows"] if r["kind"] == "long"]
        final = [r for r in res["rows"] if r["kind"] == "call"]
        server_ttft = [(r["timings"] or {}).get("ttft_ms") for r in long]
        out[arm] = {
            "completed": len(res["rows"]) == n_turns and res["error"] is None, "error": res["error"],
            "long_ttft_s": [round(r["ttft_s"], 2) for r in long],
            "long_ttft_total_s": round(sum(r["ttft_s"] for r in long), 2),
            "long_server_ttft_s": [round(x / 1e3, 2) if x is not None else None for x in server_ttft],
            "long_correct": sum(r["correct"] for r in long), "long_turns": len(long),
            "long_active": sum((r["timings"] or {}).get("specprefill") == "active" for r in long),
            "valid_call": bool(final and final[0]["valid_call"]), "right_call": bool(final and final[0]["right_call"]),
        }
    dense = out.get("specgate_dense")
    for s in out.values():
        if dense and dense["completed"] and s["completed"] and s["long_ttft_total_s"]:
            s["long_speedup_vs_dense"] = round(dense["long_ttft_total_s"] / s["long_ttft_total_s"], 3)
    return out


def run(engine: EngineConfig, quick: bool, out: Path, arms: tuple[str, ...] = ARMS) -> dict[str, Any]:
    sizes = QUICK_LONG_TOKENS if quick else LONG_TOKENS
    engine = EngineConfig(target=engine.target, speculator=engine.speculator, scorer=engine.scorer,
                          n_ctx=8192 if quick else 12288,
                          n_threads=engine.n_threads)
    turns = script(sizes)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    if out.exists():  # re-running some arms keeps the others' results
        results = {k: v for k, v in orjson.loads(out.read_bytes()).get("arms", {}).items() if k in ARMS}
    for arm in arms:
        results[arm] = run_arm(arm, engine, turns, logs)
        write_result(out, "agent_session", {"long_tokens": sizes, "n_ctx": engine.n_ctx, "arms": results,
                                            "summary": summarize(results, len(turns))},
                     {"target": engine.target, "speculator": engine.speculator})
    return summarize(results, len(turns))
