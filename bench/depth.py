"""``specgate bench depth``: a tool turn deep in an agent's context, with the scorer kept in
step by idle time.  Claude Code's recorded first request (11.8K tokens) on the real pair, as
two conversations in one server; after each first turn the server is left idle until it has
caught both scorers up; then each conversation's tool turn brings a ~2K-token tool result: one
with the default policy (SpecPrefill may score only the new tokens), one dense
(``specprefill: false``), in the same run.

Reported per turn: TTFT, tokens prefilled into the target, the scorer's cached and prefilled
tokens, the planner's status, and the idle catch-up's tokens and seconds.  Not here yet: three
tool turns with 20 s gaps, decode modes at depth, and answer checks against dense.
"""

from __future__ import annotations

import copy
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.agent_scale import FIXTURE, rss_mb, turn_done
from bench.common import bench_engine, free_port, progress, write_result
from bench.serving import server, specgate_cmd
from core.config import EngineConfig

TOOL_RESULT = "\n".join(f"2026-12-03T10:{i // 60:02d}:{i % 60:02d} unit-{i % 7} flow={i * 37 % 900} "
                        f"pressure={i * 13 % 70} status={'ALARM' if i % 97 == 0 else 'ok'}" for i in range(190))


def first_turn(task: str) -> dict[str, Any]:
    doc = copy.deepcopy(orjson.loads(FIXTURE.read_bytes())["body"])
    doc["messages"][0]["content"][-1]["text"] = task
    return {**doc, "stream": False, "max_tokens": 24}


def tool_turn(first: dict[str, Any], reply: list[dict[str, Any]], dense: bool) -> dict[str, Any]:
    messages = [*first["messages"], {"role": "assistant", "content": reply},
                {"role": "user", "content": [{"type": "text", "text": "Here is the log:\n" + TOOL_RESULT +
                                              "\nWhich unit raised an alarm first?"}]}]
    return {**first, "messages": messages, **({"specprefill": False} if dense else {})}


def caught_up(base: str) -> float:
    text = httpx.get(base + "/metrics", timeout=10).text
    return next(float(x.split()[1]) for x in text.splitlines()
                if x.startswith("specgate_speculator_caught_up_tokens_total "))


def row(arm: str, t: dict[str, Any], pid: int) -> dict[str, Any]:
    keys = ("context_n", "cache_n", "prompt_n", "ttft_ms", "prompt_ms", "specprefill", "specprefill_reason",
            "speculator_cache_n", "speculator_prefill_n", "speculator_deferred_n", "scoring_ms", "kept_pct",
            "predicted_per_second")
    return {"arm": arm, "rss_mb": rss_mb(pid), **{k: t.get(k) for k in keys}}


def run(engine: EngineConfig, out: Path, idle_timeout_s: float = 900) -> dict[str, Any]:
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "depth.log"
    port, pids = free_port(), list[int]()
    rows: list[dict[str, Any]] = []
    with server(specgate_cmd(port, engine, log_level="info"), port, log, pids) as base, \
            httpx.Client(base_url=base, timeout=3600) as http:
        firsts = {arm: first_turn(task) for arm, task in (("specprefill", "Check the pump logs."),
                                                          ("dense", "Check the valve logs."))}
        replies = {}
        for arm, body in firsts.items():
            progress(f"depth: first turn ({arm} conversation)")
            r = http.post("/v1/messages", json=body)
            r.raise_for_status()
            replies[arm] = r.json()["content"] or [{"type": "text", "text": "Looking."}]
            rows.append(row(f"{arm}: first turn", turn_done(log), pids[0]))
        goal = sum(t["context_n"] for t in rows)
        progress(f"depth: idle, catching the scorers up ({goal} tokens)")
        t0 = time.perf_counter()
        while caught_up(base) < goal * 0.98 and time.perf_counter() - t0 < idle_timeout_s:
            time.sleep(2)
        idle = {"caught_up_tokens": caught_up(base), "seconds": round(time.perf_counter() - t0, 1)}
        for arm in ("specprefill", "dense"):
            progress(f"depth: tool turn ({arm})")
            r = http.post("/v1/messages", json=tool_turn(firsts[arm], replies[arm], arm == "dense"))
            r.raise_for_status()
            rows.append(row(f"{arm}: tool turn", turn_done(log), pids[0]))
    sparse, dense = rows[-2], rows[-1]
    summary = {"idle_catch_up": idle, "tool_turn_ttft_s": {"specprefill": round(sparse["ttft_ms"] / 1e3, 2),
                                                           "dense": round(dense["ttft_ms"] / 1e3, 2)},
               "speedup": round(dense["ttft_ms"] / sparse["ttft_ms"], 3), "status": sparse["specprefill"]}
    write_result(out, "depth", {"summary": summary, "rows": rows},
                 {"target": engine.target, "speculator": engine.speculator})
    return summary


if __name__ == "__main__":  # without the bench extra: python -m bench.depth OUT.json
    print(orjson.dumps(run(bench_engine(), Path(sys.argv[1])), option=orjson.OPT_INDENT_2).decode())
