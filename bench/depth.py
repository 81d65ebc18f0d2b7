"""``specgate bench depth``: an agent's tool turns deep in its context, on the real pair.

The conversation is Claude Code's recorded first request (``tests/fixtures/clients/claude_code_first.json``)
with MCP-style tools added, ~14K tokens before the user's first word, sent over the Anthropic
Messages API with no session named, as Claude Code sends it.  Then three tool turns: the
client resends the history with its own form of the call (a ``Bash`` ``tool_use``) and a
``tool_result`` of ~2.4K tokens (a plant log with one alarm), 20 s after the previous reply,
standing for the tool's run time.

One server; first a warm-up (this agent's prompt seen before: two conversations, then idle time
until the scorers have caught up and the shared prefix's entry holds both models), then two
conversations with the same shape and the same tool results, one after the other: ``default``
(the default policy) and ``dense`` (``specprefill: false``, the same run).  Their tasks differ
by one word, so the dense one shares only the system prompt and tools with the other (the server
runs with ``--splice-min-tokens 0``, so it does not reuse the other's environment note).

Per turn: TTFT, tokens prefilled into the target and kept, scoring cost, the planner's status,
the scorer's cached/prefilled/deferred tokens, decode tokens/s, the scorer tokens caught up in
the idle gap before the turn, and the bench's checks on the reply: a tool call the tools
accept, or an answer naming the alarmed unit.  The 1.5B target is a weak agent: the checks
say whether the default policy answers as dense does, not whether either is right.  After
the default conversation's last turn, that request again (its prompt all cached) decoded in
each mode: plain, speculative and SpecAttn, at ~20K depth, then with no mode named, on a server
started with ``--decode-auto``: the mode it picks from those measurements.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.agent_scale import body, turn_done
from bench.common import bench_engine, free_port, progress, write_result
from bench.serving import metric, rss_mb, server, specgate_cmd
from core.config import EngineConfig

GAP_S = 20.0  # the tool's run time between a reply and the next request
TOOL_TURNS = 3
MAX_TOKENS = 48


def mcp_tools(n: int = 14) -> list[dict[str, Any]]:
    """MCP-style tools as a plant-operations server would list them (~150 tokens each)."""
    return [{"name": f"mcp__plant__unit_{i}_report",
             "description": (f"Reads unit {i}'s report from the plant historian: flow, pressure, temperature and "
                             "alarm state for a time range, at one-minute resolution. Use it when the user asks "
                             f"about unit {i}, its trends, or an alarm it raised; prefer it over reading raw log "
                             "files. Times are ISO 8601 in UTC. Results longer than 2,000 lines are truncated."),
             "input_schema": {"type": "object", "properties": {
                 "start": {"type": "string", "description": "first minute, ISO 8601"},
                 "end": {"type": "string", "description": "last minute, ISO 8601"},
                 "fields": {"type": "array", "items": {"type": "string", "enum": ["flow", "pressure", "temp",
                                                                                    "alarm"]}}},
                 "required": ["start", "end"]}} for i in range(n)]


def plant_log(day: int, lines: int = 60) -> tuple[str, str]:
    """A day's log (~2.4K tokens, ~40 a line) with one alarm; returns the log and the unit that alarmed."""
    which = (day * 3 + 2) % 7
    alarmed, at = f"unit-{which}", 28 + which  # about the middle: the unit's row there
    rows = []
    for i in range(lines):
        unit = f"unit-{i % 7}"
        status = "ALARM pressure over limit" if i == at else "ok"
        rows.append(f"2026-12-0{day}T10:{i // 60:02d}:{i % 60:02d}Z {unit} flow={(i * 37 + day) % 900} "
                    f"pressure={(i * 13 + day) % 70} temp={40 + i % 17} status={status}")
    return "\n".join(rows), alarmed


def first_turn(task: str) -> dict[str, Any]:
    doc = body(task)
    return {**doc, "tools": [*doc["tools"], *mcp_tools()], "max_tokens": MAX_TOKENS}


def with_tool_result(doc: dict[str, Any], k: int) -> dict[str, Any]:
    """The next request: the client's form of its ``Bash`` call, and day ``k``'s log as its result."""
    log, _ = plant_log(k)
    call = {"type": "tool_use", "id": f"toolu_{k:02d}", "name": "Bash", "input": {"command": f"cat logs/day{k}.log"}}
    return {**doc, "messages": [
        *doc["messages"],
        {"role": "assistant", "content": [{"type": "text", "text": f"I'll read day {k}'s log."}, call]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call["id"], "content": log},
                                     {"type": "text", "text": f"Which unit raised an alarm in day {k}'s log?"}]}]}


def check(reply: dict[str, Any], tools: list[dict[str, Any]], alarmed: str | None) -> dict[str, Any]:
    """A tool call to a listed tool with an object input, or text naming the alarmed unit."""
    names = {t["name"] for t in tools}
    calls = [b for b in reply.get("content", []) if b.get("type") == "tool_use"]
    text = " ".join(b.get("text", "") for b in reply.get("content", []) if b.get("type") == "text")
    valid_calls = bool(calls) and all(c["name"] in names and isinstance(c.get("input"), dict) for c in calls)
    return {"kind": "tool_call" if calls else "text", "valid_tool_call": valid_calls if calls else None,
            "names_alarmed_unit": (alarmed in text) if alarmed and not calls else None,
            "reply": (text or orjson.dumps(calls).decode())[:160]}


def settle(base: str, timeout_s: float = 1200) -> float:
    """Wait until idle work has stopped (the scorers caught up, entries completed, sessions
    checkpointed); returns the seconds waited."""
    t0 = last_change = time.perf_counter()
    last = -1.0
    while time.perf_counter() - t0 < timeout_s:
        now = metric(base, "specgate_idle_chunks_total")
        if now != last:
            last, last_change = now, time.perf_counter()
        elif time.perf_counter() - last_change > 6:
            break
        time.sleep(1)
    return round(time.perf_counter() - t0, 1)


KEYS = ("context_n", "cache_n", "prompt_n", "ttft_ms", "prompt_ms", "specprefill", "specprefill_reason",
        "speculator_cache_n", "speculator_prefill_n", "speculator_deferred_n", "scoring_ms", "predicted_per_second",
        "prefix_source", "prefix_shared_n", "constraint")


def conversation(http: httpx.Client, base: str, log: Path, pid: int, arm: str,
                 task: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The arm's four turns; returns their rows and the last request."""
    doc, rows = first_turn(task), []
    extra = {"specprefill": False} if arm == "dense" else {}
    for k in range(TOOL_TURNS + 1):
        caught0 = metric(base, "specgate_speculator_caught_up_tokens_total")
        if k:
            time.sleep(GAP_S)
            doc = with_tool_result(doc, k)
        caught = metric(base, "specgate_speculator_caught_up_tokens_total") - caught0
        progress(f"depth: {arm} turn {k}")
        r = http.post("/v1/messages", json={**doc, **extra})
        r.raise_for_status()
        t = turn_done(log)
        rows.append({"arm": arm, "turn": k, "caught_up_in_gap": caught, "rss_mb": round(rss_mb(pid), 1),
                     **{key: t.get(key) for key in KEYS},
                     "kept_pct": round(100 * t["prompt_n"] / max(1, t["context_n"] - t["cache_n"]), 1),
                     **check(r.json(), doc["tools"], plant_log(k)[1] if k else None)})
    return rows, doc


MODES: tuple[tuple[str, dict[str, Any]], ...] = (  # last: no mode named, the server picks (--decode-auto)
    ("plain", {"speculative": False}), ("speculative", {"speculative": True}), ("specattn", {"specattn": True}),
    ("auto", {}))


def decode_modes(http: httpx.Client, log: Path, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """The last tool turn's request again, its prompt all cached, decoded 64 tokens in each mode,
    then with no mode named: what ``--decode-auto`` picks from those measurements."""
    rows = []
    for mode, extra in MODES:
        progress(f"depth: decoding at depth, {mode}")
        r = http.post("/v1/messages", json={**doc, "max_tokens": 64, **extra})
        if r.status_code == 400:  # SpecAttn needs --kv-layout unified; the default server is split
            rows.append({"mode": mode, "error": r.json()["error"]["message"], "predicted_per_second": None})
            continue
        r.raise_for_status()
        t = turn_done(log)
        rows.append({"mode": mode, **{k: t.get(k) for k in ("decode_mode", "context_n", "cache_n", "predicted_n",
                                                            "predicted_per_second", "draft_acceptance",
                                                            "kv_selected_fraction", "constraint")}})
    return rows


def run(engine: EngineConfig, out: Path, kv_layout: str = "split") -> dict[str, Any]:
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{out.stem}.log"  # depth.log, depth_unified.log
    port, pids = free_port(), list[int]()
    # no splicing: the dense conversation would start from the default one's environment note,
    # moved into place, and be neither dense nor comparable on its first turn
    cmd = specgate_cmd(port, engine, log_level="info", decode_auto="true", splice_min_tokens=0, kv_layout=kv_layout)
    with server(cmd, port, log, pids) as base, \
            httpx.Client(base_url=base, timeout=3600) as http:
        warm = []
        for task in ("Warm-up: say hello.", "Warm-up: say hi."):
            progress(f"depth: warm-up ({task})")
            http.post("/v1/messages", json=first_turn(task)).raise_for_status()
            warm.append({key: turn_done(log).get(key) for key in KEYS})
        idle = {"seconds": settle(base), "caught_up_tokens": metric(base, "specgate_speculator_caught_up_tokens_total"),
                "prefix_completed": metric(base, "specgate_prefix_completed_total")}
        rows, last = conversation(http, base, log, pids[0], "default", "Task A: find which unit raised an alarm.")
        modes = decode_modes(http, log, last)
        settle(base)
        rows += conversation(http, base, log, pids[0], "dense", "Task B: find which unit raised an alarm.")[0]
    return summarize(warm, idle, rows, modes, out, engine, kv_layout)


def summarize(warm: list[dict[str, Any]], idle: dict[str, Any], rows: list[dict[str, Any]],
              modes: list[dict[str, Any]], out: Path, engine: EngineConfig,
              kv_layout: str = "split") -> dict[str, Any]:
    by = {(r["arm"], r["turn"]): r for r in rows}
    turns = []
    for k in range(TOOL_TURNS + 1):
        d, x = by[("default", k)], by[("dense", k)]
        turns.append({"turn": k, "depth": d["context_n"], "new_tokens": d["context_n"] - d["cache_n"],
                      "ttft_s": {"default": round(d["ttft_ms"] / 1e3, 1), "dense": round(x["ttft_ms"] / 1e3, 1)},
                      "speedup": round(x["ttft_ms"] / d["ttft_ms"], 2), "status": d["specprefill"],
                      "kept_pct": d["kept_pct"], "scoring_s": round((d["scoring_ms"] or 0) / 1e3, 1),
                      "decode_tok_s": {"default": d["predicted_per_second"], "dense": x["predicted_per_second"]},
                      "caught_up_in_gap": d["caught_up_in_gap"],
                      "checks": {"default": [d["kind"], d["valid_tool_call"], d["names_alarmed_unit"]],
                                 "dense": [x["kind"], x["valid_tool_call"], x["names_alarmed_unit"]]}})
    deep = [t for t in turns if t["turn"] and t["depth"] >= 14000]
    summary = {"warm_up_idle": idle, "turns": turns,
               "tool_turns_at_14k_speedup": [t["speedup"] for t in deep],
               "decode_tok_s_at_depth": {m["mode"]: m["predicted_per_second"] for m in modes},
               "decode_depth": modes[0].get("context_n")}
    write_result(out, "depth", {"params": {"gap_s": GAP_S, "tool_turns": TOOL_TURNS, "max_tokens": MAX_TOKENS,
                                           "kv_layout": kv_layout},
                                "summary": summary, "warm_up": warm, "rows": rows, "decode_modes": modes},
                 {"target": engine.target, "speculator": engine.speculator})
    return summary


if __name__ == "__main__":  # without the bench extra: python -m bench.depth OUT.json
    print(orjson.dumps(run(bench_engine(), Path(sys.argv[1])), option=orjson.OPT_INDENT_2).decode())
