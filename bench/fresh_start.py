"""``specgate bench fresh_start``: an agent's first tool turns on a fresh server (issue 52, point 4).

``bench depth`` waits out idle time after its warm-up, so its tool turns find their scorer
caught up.  A real agent on a new server does not wait: its first request (the system prompt
and tools, ~14.8K tokens) comes cold, and its first tool turn 20 s after the reply.  The tool
guard keeps that first turn whole, so nothing scores it, and idle time catches up only a few
thousand tokens of the scorer in 20 s: the tool turn then ran densely (``skipped_break_even``).

Two fresh servers, the same requests as ``bench depth`` (Claude Code's recorded request with
MCP tools, then three tool turns of ~2.4K tokens 20 s apart):

- ``ahead``: the default server, where a dense turn of ``--scorer-ahead-tokens`` (4096) or more
  brings its scorer along through the scoring window.  After its conversation, a second one on
  the same server with SpecPrefill off (``dense``: it shares the prefix, then prefills every
  tool result whole): the dense reference at the same depths, in the same run;
- ``today``: ``--scorer-ahead-tokens 0``, the scorer left to idle time (the behaviour before):
  what the first turn cost, and what its tool turns did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx

from bench.common import free_port, write_result
from bench.depth import conversation
from bench.serving import server, specgate_cmd
from core.config import EngineConfig


def serve_and_talk(engine: EngineConfig, logs: Path, name: str, arms: tuple[str, ...],
                   **flags: Any) -> list[dict[str, Any]]:
    port, pids = free_port(), list[int]()
    log = logs / f"fresh_start_{name}.log"
    cmd = specgate_cmd(port, engine, log_level="info", splice_min_tokens=0, **flags)
    rows: list[dict[str, Any]] = []
    with server(cmd, port, log, pids) as base, httpx.Client(base_url=base, timeout=3600) as http:
        for arm in arms:
            task = "Task A: find which unit raised an alarm." if arm == "default" else \
                "Task B: find which unit raised an alarm."
            got, _ = conversation(http, base, log, pids[0], arm, task)
            rows += [{**r, "server": name} for r in got]
    return rows


def run(engine: EngineConfig, out: Path) -> dict[str, Any]:
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows = serve_and_talk(engine, logs, "ahead", ("default", "dense"))
    rows += serve_and_talk(engine, logs, "today", ("default",), scorer_ahead_tokens=0)
    by = {(r["server"], r["arm"], r["turn"]): r for r in rows}
    turns = []
    for k in sorted({r["turn"] for r in rows}):
        ahead, today, dense = by[("ahead", "default", k)], by[("today", "default", k)], by[("ahead", "dense", k)]
        turns.append({"turn": k, "depth": ahead["context_n"], "new_tokens": ahead["context_n"] - ahead["cache_n"],
                      "ttft_s": {"ahead": round(ahead["ttft_ms"] / 1e3, 1), "today": round(today["ttft_ms"] / 1e3, 1),
                                 "dense": round(dense["ttft_ms"] / 1e3, 1)},
                      "speedup_vs_dense": {"ahead": round(dense["ttft_ms"] / ahead["ttft_ms"], 2),
                                           "today": round(dense["ttft_ms"] / today["ttft_ms"], 2)},
                      "status": {"ahead": ahead["specprefill"], "today": today["specprefill"]},
                      "kept_pct": {"ahead": ahead["kept_pct"], "today": today["kept_pct"]},
                      "scorer_caught_up_in_gap": {"ahead": ahead["caught_up_in_gap"],
                                                  "today": today["caught_up_in_gap"]}})
    first = turns[0]["ttft_s"]
    summary = {"first_turn_cost_vs_today": round(first["ahead"] / first["today"], 3),
               "tool_turn_speedups_vs_dense": {"ahead": [t["speedup_vs_dense"]["ahead"] for t in turns[1:]],
                                               "today": [t["speedup_vs_dense"]["today"] for t in turns[1:]]},
               "turns": turns}
    write_result(out, "fresh_start", {"summary": summary, "rows": rows},
                 {"target": engine.target, "speculator": engine.speculator})
    return summary
