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
   arrives (the prefix is read back from the tier);
5. named, then after_sigkill: on that server, a conversation naming its session (as an agent
   framework that names one does) runs a turn; idle time checkpoints its KV to the tier; the
   server is SIGKILLed, leaving its lease in Redis; a new server on another port (another
   replica) gets the conversation's next turn, takes the session over from its dead owner,
   and restores the checkpoint instead of prefilling the conversation.

Every server shares one redis-server and the tier folder.  For each arm: the server's TTFT,
tokens prefilled into the target, tokens reused and how; with the tier's bytes on disk and the
server's RSS.  The cold run is the dense recompute the others are compared with, measured in
the same run.  Not here yet: HAProxy in front of the replicas (neither the tier nor the
takeover depends on it; tests/integration/test_takeover_kv.py runs it), the Redis backend,
and llama-server as a peer.
"""

from __future__ import annotations

import copy
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import bench_engine, free_port, progress, write_result
from bench.serving import redis_server, server, specgate_cmd
from core.config import EngineConfig

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/clients/claude_code_first.json"
TASKS = ("Say hello", "List the files in this repository.", "Which tests are there?", "What does the README say?",
         "Find the failing test.")


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
    with redis_server() as rport:
        def serve(name: str) -> tuple[Any, Path, list[int]]:
            port, pids = free_port(), list[int]()
            log = logs / f"agent_scale_{name}.log"
            cmd = specgate_cmd(port, engine, kv_tier_dir=str(tier), log_level="info",
                               redis_url=f"redis://127.0.0.1:{rport}/0")
            return server(cmd, port, log, pids), log, pids

        def ask(base: str, log: Path, pid: int, arm: str, doc: dict[str, Any], sid: str = "") -> None:
            progress(f"agent_scale: {arm}")
            r = httpx.post(base + "/v1/messages", json=doc, timeout=3600,
                           headers={"X-SpecGate-Session": sid} if sid else {})
            r.raise_for_status()
            rows.append(row(arm, turn_done(log, 0), r.elapsed.total_seconds(), pid))

        first, first_log, first_pids = serve("first")
        with first as base:
            ask(base, first_log, first_pids[0], "cold", body(TASKS[0]))
            ask(base, first_log, first_pids[0], "sibling", body(TASKS[1]))
            # the tier's writes run off the reply path, and idle work (the scorers caught up, both
            # sessions checkpointed) would share these 2 cores with the replica: let both finish
            wait_for(lambda: checkpoints(base) >= 2)
            second, second_log, second_pids = serve("replica")
            with second as base2:
                ask(base2, second_log, second_pids[0], "replica", body(TASKS[2]))
        again, again_log, again_pids = serve("restarted")
        with again as base:
            ask(base, again_log, again_pids[0], "restarted", body(TASKS[3]))
            ask(base, again_log, again_pids[0], "named", body(TASKS[4]), SESSION)
            wait_for(lambda: checkpoints(base) >= 2)  # written (not only queued): this arm's and the named one
            os.kill(again_pids[0], signal.SIGKILL)  # the owner dies; its lease is left in Redis
        survivor, survivor_log, survivor_pids = serve("survivor")
        with survivor as base:
            ask(base, survivor_log, survivor_pids[0], "after_sigkill", next_turn(body(TASKS[4])), SESSION)
    return summarize(rows, tier, out, engine)


SESSION = "agent-1"


def next_turn(doc: dict[str, Any]) -> dict[str, Any]:
    """The conversation's next request: its reply so far and a new instruction."""
    return {**doc, "messages": [*doc["messages"], {"role": "assistant", "content": "I will look."},
                                {"role": "user", "content": "Now run the tests and report what fails."}]}


def checkpoints(base: str) -> float:
    """Session checkpoints the server has written to the tier (its index landed after the entry)."""
    text = httpx.get(base + "/metrics", timeout=30).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("specgate_session_checkpoints_total "))


def wait_for(check: Callable[[], bool], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("agent_scale: waited too long for the KV tier")
        time.sleep(0.5)


def summarize(rows: list[dict[str, Any]], tier: Path, out: Path, engine: EngineConfig) -> dict[str, Any]:
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
