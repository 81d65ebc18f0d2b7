"""``specgate bench agent_scale``: what a coding agent's prefix costs once computed.  Claude
Code's recorded first request (``tests/fixtures/clients/claude_code_first.json``: ~55 KB,
its system prompt and 20-odd tools) on the real pair, through the Anthropic Messages API
with no session named, as Claude Code sends it:

1. cold: the first conversation (dense: the tool guard keeps every token);
2. sibling: another task with the same system prompt and tools, same process (the prefix
   is copied from the first conversation's KV, and the prefix-cache entry filled from
   that copy and written to the KV tier);
3. replica: a second server, started beside the first on the same KV tier folder (a
   shared mount), gets a third task: it has never seen the prompt, and reads the prefix
   the first one wrote;
4. restarted: both are stopped, one is started again on that folder, and a fourth task
   arrives (the prefix is read back from the tier).

For each: the server's TTFT, tokens prefilled into the target, tokens reused and how; with
the tier's bytes on disk and the server's RSS.  The cold run is the dense recompute the
others are compared with, measured in the same run.  Not here yet: HAProxy in front of the
replicas (the tier does not depend on it), a SIGKILLed owner, the Redis backend, and
llama-server as a peer.
"""

from __future__ import annotations

import copy
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import bench_engine, free_port, progress, write_result
from bench.serving import server, specgate_cmd
from core.config import EngineConfig

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/clients/claude_code_first.json"
TASKS = ("Say hello", "List the files in this repository.", "Which tests are there?", "What does the README say?")


def body(task: str) -> dict[str, Any]:
    """The recorded request, its last text block (the user's task) replaced, not streamed."""
    doc = copy.deepcopy(orjson.loads(FIXTURE.read_bytes())["body"])
    doc["messages"][0]["content"][-1]["text"] = task
    return {**doc, "stream": False, "max_tokens": 8}


def turn_done(log: Path, skip: int) -> dict[str, Any]:
    """The ``turn_done`` events of the server's log, after the first ``skip``: the last one."""
    events = [orjson.loads(line) for line in log.read_bytes().splitlines() if b'"turn_done"' in line]
    return events[skip:][-1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def row(arm: str, t: dict[str, Any], wall_s: float, pid: int) -> dict[str, Any]:
    keys = ("context_n", "cache_n", "prompt_n", "prefix_shared_n", "prefix_built_n", "ttft_ms", "specprefill",
            "speculator_prefill_n", "speculator_deferred_n")
    return {"arm": arm, "wall_s": round(wall_s, 1), "rss_mb": rss_mb(pid), **{k: t.get(k) for k in keys}}


def run(engine: EngineConfig, out: Path) -> dict[str, Any]:
    tier = Path(tempfile.mkdtemp(prefix="specgate-kv-tier-"))
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []

    def ask(http: httpx.Client, log: Path, pid: int, arm: str, task: str) -> None:
        progress(f"agent_scale: {arm}")
        r = http.post("/v1/messages", json=body(task))
        r.raise_for_status()
        rows.append(row(arm, turn_done(log, 0), r.elapsed.total_seconds(), pid))

    def serve(name: str) -> tuple[Any, Path, list[int]]:
        port, pids = free_port(), list[int]()
        log = logs / f"agent_scale_{name}.log"
        return server(specgate_cmd(port, engine, kv_tier_dir=str(tier), log_level="info"), port, log, pids), log, pids

    first, first_log, first_pids = serve("first")
    with first as base, httpx.Client(base_url=base, timeout=3600) as http:
        ask(http, first_log, first_pids[0], "cold", TASKS[0])
        ask(http, first_log, first_pids[0], "sibling", TASKS[1])
        deadline = time.monotonic() + 120  # the tier's write runs off the reply path
        while not any(tier.rglob("*.kv")) and time.monotonic() < deadline:
            time.sleep(0.5)
        second, second_log, second_pids = serve("replica")
        with second as base2, httpx.Client(base_url=base2, timeout=3600) as http2:
            ask(http2, second_log, second_pids[0], "replica", TASKS[2])
    again, again_log, again_pids = serve("restarted")
    with again as base, httpx.Client(base_url=base, timeout=3600) as http:
        ask(http, again_log, again_pids[0], "restarted", TASKS[3])
    tier_bytes = sum(p.stat().st_size for p in tier.rglob("*.kv"))
    cold = rows[0]["ttft_ms"]
    summary: dict[str, Any] = {
        r["arm"]: {"ttft_s": round(r["ttft_ms"] / 1e3, 2), "vs_cold": round(r["ttft_ms"] / cold, 3),
                   "prefilled": r["prompt_n"], "reused": r["cache_n"]} for r in rows}
    summary["kv_tier_bytes"] = tier_bytes
    write_result(out, "agent_scale", {"summary": summary, "rows": rows},
                 {"target": engine.target, "speculator": engine.speculator})
    return summary


if __name__ == "__main__":  # without the bench extra: python -m bench.agent_scale OUT.json
    print(orjson.dumps(run(bench_engine(), Path(sys.argv[1])), option=orjson.OPT_INDENT_2).decode())
