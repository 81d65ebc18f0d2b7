"""``specgate bench agent_scale``: what a coding agent's prefix costs once computed.  Claude
Code's recorded first request (``tests/fixtures/clients/claude_code_first.json``: ~55 KB,
its system prompt and 20-odd tools) on the real pair, through the Anthropic Messages API
with no session named, as Claude Code sends it:

1. cold: the first conversation (dense: the tool guard keeps every token);
2. sibling: another task with the same system prompt and tools, same process (the prefix
   is copied from the first conversation's KV; the prefix-cache entry is filled from it
   in idle time and written to the KV tier), then its next turn, ``sibling_next``: a
   request with a few new tokens and no prefix work, the sibling's reference;
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

Then the same cold, sibling and replica arms on the Redis backend (``--kv-tier-dir redis://``,
for deployments with Redis and no shared disk), and cold, sibling and sibling_next on one
unified KV pool (``--kv-layout unified``: slots share cells, so a sibling's prefix is shared,
not copied, and only the spliced run's cells move).

Last, the peer a user would pick instead, on the same requests: llama.cpp's own
``llama-server`` (``ops/build_llama_server.sh``), one slot, its RAM prompt cache and
``--cache-reuse 256``, through its own Anthropic endpoint, streamed: cold, sibling, and a
restarted process (which is also what a second replica is to it: it keeps no KV beyond its
process).  Its TTFT is the client's wait for the first content delta; its reused and
prefilled tokens are what its ``usage`` reports.

Every server shares one redis-server.  For each arm: the server's TTFT, tokens prefilled into
the target, tokens reused and where they came from (a resident session, the tier, a
checkpoint), the time and bytes of reading them back; with the tier's bytes and the server's
RSS.  Each backend's cold run is the dense recompute the others are compared with, measured
in the same run.  Not here yet: HAProxy in front of the replicas (neither the tier nor the
takeover depends on it; tests/integration/test_takeover_kv.py runs it).
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
from bench.serving import metric, native_server_cmd, redis_server, rss_mb, server, specgate_cmd
from core.config import EngineConfig

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/clients/claude_code_first.json"
TASKS = ("Say hello", "List the files in this repository.", "Which tests are there?", "What does the README say?",
         "Find the failing test.")


def body(task: str) -> dict[str, Any]:
    """The recorded request, its last text block (the user's task) replaced, not streamed."""
    doc = copy.deepcopy(orjson.loads(FIXTURE.read_bytes())["body"])
    doc["messages"][0]["content"][-1]["text"] = task
    return {**doc, "stream": False, "max_tokens": 8}


def row(arm: str, t: dict[str, Any], wall_s: float, pid: int, backend: str) -> dict[str, Any]:
    keys = ("context_n", "cache_n", "prompt_n", "prompt_ms", "prefix_shared_n", "prefix_built_n", "prefix_source",
            "prefix_ms", "prefix_bytes", "prefix_spliced_n", "ttft_ms", "specprefill", "speculator_prefill_n",
            "speculator_deferred_n")
    return {"arm": arm, "backend": backend, "wall_s": round(wall_s, 1), "rss_mb": round(rss_mb(pid), 1),
            **{k: t.get(k) for k in keys}}


class Arms:
    """Servers on one KV tier (a folder or a Redis URL) beside one redis-server, and the rows
    of the requests sent to them."""

    def __init__(self, engine: EngineConfig, tier: str, backend: str, redis_port: int, logs: Path,
                 **flags: str) -> None:
        self.engine, self.tier, self.backend, self.redis_port, self.logs = engine, tier, backend, redis_port, logs
        self.flags = flags  # more serve flags
        self.rows: list[dict[str, Any]] = []

    def serve(self, name: str) -> tuple[Any, Path, list[int]]:
        port, pids = free_port(), list[int]()
        log = self.logs / f"agent_scale_{self.backend}_{name}.log"
        cmd = specgate_cmd(port, self.engine, kv_tier_dir=self.tier, log_level="info",
                           redis_url=f"redis://127.0.0.1:{self.redis_port}/0", **self.flags)
        return server(cmd, port, log, pids), log, pids

    def ask(self, base: str, log: Path, pid: int, arm: str, doc: dict[str, Any], sid: str = "") -> dict[str, Any]:
        """Send ``doc``; its row is kept, and the reply returned."""
        progress(f"agent_scale: {self.backend} {arm}")
        headers = {"X-SpecGate-Session": sid} if sid else {}
        r = httpx.post(base + "/v1/messages", json=doc, timeout=3600, headers=headers)
        r.raise_for_status()
        self.rows.append(row(arm, turn_done(log), r.elapsed.total_seconds(), pid, self.backend))
        reply: dict[str, Any] = r.json()
        return reply


def turn_done(log: Path) -> dict[str, Any]:
    """The last ``turn_done`` event of the server's log."""
    return [orjson.loads(line) for line in log.read_bytes().splitlines() if b'"turn_done"' in line][-1]


BACKENDS = ("directory", "redis", "unified", "stopped", "llama_server")


def run(engine: EngineConfig, out: Path, backends: tuple[str, ...] = BACKENDS) -> dict[str, Any]:
    tier = Path(tempfile.mkdtemp(prefix="specgate-kv-tier-"))
    logs = out.parent / "logs" / ("" if backends == BACKENDS else out.stem)  # a partial run keeps its own logs
    logs.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    redis_bytes = 0
    with redis_server() as rport:
        if "directory" in backends:
            folder = Arms(engine, str(tier), "directory", rport, logs, kv_layout="split")
            directory_arms(folder)
            rows += folder.rows
        if "redis" in backends:
            redis = Arms(engine, f"redis://127.0.0.1:{rport}/1", "redis", rport, logs, kv_layout="split")
            redis_arms(redis)
            redis_bytes = redis_used(rport)
            rows += redis.rows
        if "unified" in backends:
            unified = Arms(engine, tempfile.mkdtemp(prefix="specgate-kv-tier-"), "unified", rport, logs,
                           kv_layout="unified")
            unified_arms(unified)
            rows += unified.rows
        if "stopped" in backends:
            stopped = Arms(engine, tempfile.mkdtemp(prefix="specgate-kv-tier-"), "stopped", rport, logs,
                           kv_layout="split")
            stopped_arms(stopped)
            rows += stopped.rows
    if "llama_server" in backends:
        rows += llama_server_arms(engine, logs)
    return summarize(rows, tier, redis_bytes, out, engine)


def directory_arms(a: Arms) -> None:
    first_and_replica(a)
    again, again_log, again_pids = a.serve("restarted")
    with again as base:
        a.ask(base, again_log, again_pids[0], "restarted", body(TASKS[3]))
        a.ask(base, again_log, again_pids[0], "named", body(TASKS[4]), SESSION)
        wait_for(lambda: checkpoints(base) >= 2)  # written (not only queued): this arm's and the named one
        os.kill(again_pids[0], signal.SIGKILL)  # the owner dies; its lease is left in Redis
    survivor, survivor_log, survivor_pids = a.serve("survivor")
    with survivor as base:
        a.ask(base, survivor_log, survivor_pids[0], "after_sigkill", next_turn(body(TASKS[4])), SESSION)


def stopped_arms(a: Arms) -> None:
    """cold and sibling, then SIGTERM 0.3 s after the sibling's reply: before idle work has
    copied the shared prefix's entry, or checkpointed either conversation.  The drain owes
    the tier both (issue 51, point 9); a server started again on the folder gets a new task,
    ``after_stop``, which should start from what the drain wrote, not prefill it all."""
    first, first_log, first_pids = a.serve("first")
    with first as base:
        a.ask(base, first_log, first_pids[0], "cold", body(TASKS[0]))
        a.ask(base, first_log, first_pids[0], "sibling", body(TASKS[1]))
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(first_pids[0], signal.SIGTERM)
        wait_for(lambda: not alive(first_pids[0]), 300)
        drain = [orjson.loads(x) for x in first_log.read_bytes().splitlines() if b'"drain_done"' in x]
        a.rows.append({"arm": "drain", "backend": a.backend, "wall_s": round(time.monotonic() - t0, 1),
                       **(drain[-1] if drain else {})})
    again, again_log, again_pids = a.serve("restarted")
    with again as base:
        a.ask(base, again_log, again_pids[0], "after_stop", body(TASKS[3]))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited: its parent just has not reaped it
        return f.read().split(")")[-1].split()[0] != "Z"


def redis_arms(a: Arms) -> None:
    """The Redis backend (no shared disk): a first server fills it, a second one beside it reads."""
    first_and_replica(a)


def unified_arms(a: Arms) -> None:
    """One unified pool: cold, sibling and its reference on one server."""
    first, first_log, first_pids = a.serve("first")
    with first as base:
        siblings(a, base, first_log, first_pids[0])


def siblings(a: Arms, base: str, log: Path, pid: int) -> None:
    """cold, sibling, and the sibling's next turn (its reference: its own reply sent back and
    two words, a few new tokens and no prefix work), each after the idle work the one before
    left (the entry's copy, the scorers caught up)."""
    for arm, task in (("cold", TASKS[0]), ("sibling", TASKS[1])):
        reply = a.ask(base, log, pid, arm, body(task))
        quiet(base)
    text = [b for b in reply["content"] if b.get("type") == "text"]  # a call would need its result sent
    a.ask(base, log, pid, "sibling_next", next_turn(body(TASKS[1]), text or "I will look.", "Go on."))
    quiet(base)


def first_and_replica(a: Arms) -> None:
    """cold and sibling on a first server, then replica on a second one beside it (same tier)."""
    first, first_log, first_pids = a.serve("first")
    with first as base:
        siblings(a, base, first_log, first_pids[0])
        # the tier's writes run off the reply path, and idle work (the scorers caught up, both
        # sessions checkpointed) would share these 2 cores with the replica: let both finish
        wait_for(lambda: checkpoints(base) >= 2)
        second, second_log, second_pids = a.serve("replica")
        with second as base2:
            a.ask(base2, second_log, second_pids[0], "replica", body(TASKS[2]))


def llama_server_arms(engine: EngineConfig, logs: Path) -> list[dict[str, Any]]:
    """cold and sibling on one llama-server, then restarted on a new process."""
    rows: list[dict[str, Any]] = []
    for name, arms in (("first", (("cold", TASKS[0]), ("sibling", TASKS[1]))),
                       ("restarted", (("restarted", TASKS[3]),))):
        port, pids, log = free_port(), list[int](), logs / f"agent_scale_llama_server_{name}.log"
        cmd = native_server_cmd(port, engine, slots=1) + ["--cache-reuse", "256"]
        with server(cmd, port, log, pids) as base:
            for arm, task in arms:
                progress(f"agent_scale: llama_server {arm}")
                rows.append(streamed_row(base, arm, {**body(task), "stream": True}, log, pids[0]))
    return rows


def streamed_row(base: str, arm: str, doc: dict[str, Any], log: Path, pid: int) -> dict[str, Any]:
    """One streamed Messages request to llama-server: the wait for its first content delta,
    and its ``usage`` (sent with ``message_start``, once the prompt is processed)."""
    t0 = time.perf_counter()
    ttft_ms, usage = 0.0, dict[str, int]()
    with httpx.stream("POST", base + "/v1/messages", json=doc, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            event = orjson.loads(line[5:])
            if event.get("type") == "message_start":
                usage = event["message"]["usage"]
            elif event.get("type") == "content_block_delta" and not ttft_ms:
                ttft_ms = (time.perf_counter() - t0) * 1e3
    cached, prefilled = usage["cache_read_input_tokens"], usage["input_tokens"]
    return {"arm": arm, "backend": "llama_server", "wall_s": round(time.perf_counter() - t0, 1),
            "rss_mb": round(rss_mb(pid), 1), "context_n": cached + prefilled, "cache_n": cached,
            "prompt_n": prefilled, "prompt_ms": prompt_eval_ms(log), "ttft_ms": round(ttft_ms, 2)}


def prompt_eval_ms(log: Path) -> float:
    """llama-server's last ``prompt eval time = X ms`` line."""
    lines = [x for x in log.read_text(errors="replace").splitlines() if "prompt eval time" in x]
    return float(lines[-1].split("=")[1].split("ms")[0]) if lines else 0.0


def redis_used(port: int) -> int:
    import redis

    return int(redis.Redis(port=port).info("memory")["used_memory"])


SESSION = "agent-1"


def next_turn(doc: dict[str, Any], reply: Any = "I will look.",
              ask: str = "Now run the tests and report what fails.") -> dict[str, Any]:
    """The conversation's next request: its reply so far and a new instruction."""
    return {**doc, "messages": [*doc["messages"], {"role": "assistant", "content": reply},
                                {"role": "user", "content": ask}]}


def checkpoints(base: str) -> float:
    """Session checkpoints the server has written to the tier (its index landed after the entry)."""
    return metric(base, "specgate_session_checkpoints_total")


def quiet(base: str, settle_s: float = 10.0) -> None:
    """Wait until the server's idle work (scorers caught up, entries copied, checkpoints) has
    run out: its count of idle chunks stops moving for ``settle_s`` (one catch-up chunk at
    12K deep takes ~3 s on the 2-core VM, and is counted when it ends)."""
    last, since = -1.0, time.monotonic()
    while time.monotonic() - since < settle_s:
        time.sleep(0.5)
        now = metric(base, "specgate_idle_chunks_total")
        if now != last:
            last, since = now, time.monotonic()


def wait_for(check: Callable[[], bool], timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError("agent_scale: waited too long for the KV tier")
        time.sleep(0.5)


def summarize(rows: list[dict[str, Any]], tier: Path, redis_bytes: int, out: Path,
              engine: EngineConfig) -> dict[str, Any]:
    """Per arm, against the cold run of its backend (the dense recompute, same run): TTFT,
    tokens prefilled and reused; for a prefix read back, its load time and rate, and its share
    of what prefilling those tokens densely cost in the cold run."""
    summary: dict[str, Any] = {}
    for r in rows:
        if r["arm"] == "drain":  # the stop's own figures: how long it took, what it wrote
            summary[f"{r['backend']}/drain"] = {k: r.get(k) for k in ("wall_s", "kv_saved", "kv_left",
                                                                      "kv_writes_landed")}
            continue
        cold = next(c for c in rows if c["backend"] == r["backend"] and c["arm"] == "cold")
        dense_per_token_ms = cold["prompt_ms"] / cold["prompt_n"]
        one = {"ttft_s": round(r["ttft_ms"] / 1e3, 2), "vs_cold": round(r["ttft_ms"] / cold["ttft_ms"], 3),
               "prefilled": r["prompt_n"], "reused": r["cache_n"],
               "cached_share": round(r["cache_n"] / r["context_n"], 3)}
        if r.get("prefix_spliced_n"):
            one["spliced"] = r["prefix_spliced_n"]
        if r.get("prefix_bytes"):
            one.update({"loaded_from": r["prefix_source"], "load_s": round(r["prefix_ms"] / 1e3, 2),
                        "load_gb_per_s": round(r["prefix_bytes"] / 1e9 / (r["prefix_ms"] / 1e3), 2),
                        "load_vs_dense_prefill": round(r["prefix_ms"] / (r["prefix_shared_n"] * dense_per_token_ms),
                                                       3)})
        ref = next((c for c in rows if c["backend"] == r["backend"] and c["arm"] == "sibling_next"), None)
        if r["arm"] == "sibling" and ref is not None:  # the bound: within 1.2x of its next turn
            one["vs_reference"] = round(r["ttft_ms"] / ref["ttft_ms"], 2)
        summary[f"{r['backend']}/{r['arm']}"] = one
    summary["kv_tier_bytes"] = {"directory": sum(p.stat().st_size for p in tier.rglob("*.kv")),
                                "redis_used_memory": redis_bytes}
    write_result(out, "agent_scale", {"summary": summary, "rows": rows},
                 {"target": engine.target, "speculator": engine.speculator})
    return summary


if __name__ == "__main__":  # without the bench extra: python -m bench.agent_scale OUT.json
    print(orjson.dumps(run(bench_engine(), Path(sys.argv[1])), option=orjson.OPT_INDENT_2).decode())
