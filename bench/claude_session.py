"""``specgate bench claude_session``: real Claude Code, unchanged, in one session that outgrows
the window (issue 54).

The deployment ``ops/cluster.sh up 1`` starts (redis-server, one replica, HAProxy) serves the
real pair with a window of ``--n-ctx`` (default 20480: a 32K run to 2x takes hours on 2 cores);
Claude Code runs with exactly what ``specgate launch claude`` sets.  In a scratch git repository
of generated Python modules (evals.agent_files), each turn is ``claude -p`` (``--resume`` of the
same conversation after the first) whose prompt attaches one module with an ``@`` mention (Claude
Code reads the file and puts it in the user message) and asks about it: a function's exact
source, a constant's value, a definition's line.  Every third turn asks instead about a module
attached 3+ turns earlier, with no new file.  It stops once the conversation is ``--turns``
long or twice the window.

For each turn: the CLI's exit and reply, whether the reply holds the answer, and from the
replica's log each request it served (logical and physical length, cells evicted, reuse, TTFT)
and any refusal.  The 1.5B target is a weak agent: a wrong answer is recorded, not bent around.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import agent_clis
from bench.cluster import running
from bench.coding_agents import TURN_KEYS, claude_result, cli_versions, served
from bench.common import progress, write_result
from bench.long_session import module
from cli.launch import claude as claude_launch
from cli.launch import server_info
from core.config import EngineConfig
from evals.agent_files import Question, ToolResult, correct

N_CTX = 20480
EXTRA_KEYS = ("physical_n", "evicted_n", "evict_ms")


def source(result: ToolResult) -> str:
    """The module's text, from its ``cat -n`` form."""
    return "\n".join(line.split("\t", 1)[1] for line in result.content.splitlines()) + "\n"


def ask(q: Question, path: str, attach: bool) -> str:
    """The turn's prompt: the question, with the module attached (``@path``) when it is new."""
    text = q.ask
    if text.startswith("Read ") and ". Then r" in text:  # "Read PATH. Then reply ...": the mention reads it
        text = "R" + text.split(". Then r", 1)[1]
    return f"@{path} {text}" if attach else text


def turn_plan(rng: random.Random, i: int, files: list[ToolResult]) -> tuple[Question, ToolResult, bool]:
    """Turn ``i``'s question, the module it is about, and whether that module is attached now."""
    if i >= 4 and i % 3 == 0:
        old = files[rng.randint(0, len(files) - 3)]
        pool = [q for q in old.questions if q.kind != "function_source"]
        return rng.choice(pool), old, False
    new = module(rng, len(files))
    kinds = ("function_source", "constant_value", "definition_line")
    pool = [q for q in new.questions if q.kind == kinds[i % 3]] or list(new.questions)
    files.append(new)
    return rng.choice(pool), new, True


def run(engine: EngineConfig, out: Path, turns: int = 12, n_ctx: int = N_CTX,
        seed: int | None = None) -> dict[str, Any]:
    if gone := agent_clis.missing():
        raise RuntimeError(f"{gone} missing: `bash ops/setup.sh --test` installs the agent CLIs")
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
    rng, files, rows = random.Random(seed), list[ToolResult](), list[dict[str, Any]]()
    work = Path(tempfile.mkdtemp(prefix="specgate-claude-session-"))
    env = {"SPECGATE_TARGET": engine.target, "SPECGATE_SPECULATOR": engine.speculator, "SPECGATE_N_CTX": str(n_ctx),
           "SPECGATE_KV_TIER_DIR": str(work / "tier"), "SPECGATE_LOG_LEVEL": "info"}
    with running(work / "cluster", 1, env) as cluster:
        log, mark = cluster.dir / "replica-1.log", 0
        info = server_info(cluster.base, "sk-bench")
        claude_env = {**claude_launch(info, "sk-bench", work / "launch").env, "IS_SANDBOX": "1"}
        repo = agent_clis.scratch_repo(work / "claude")
        progress(f"claude_session: seed {seed}, window {n_ctx}, limit {info.window}, env {sorted(claude_env)}")
        session_id: str | None = None
        for i in range(turns):
            q, result, attach = turn_plan(rng, i, files)
            path = result.arguments["file_path"]
            if attach:
                (repo / path).parent.mkdir(parents=True, exist_ok=True)
                (repo / path).write_text(source(result))
            args = ["-p", ask(q, path, attach), "--output-format", "json", "--max-turns", "4"]
            if session_id:
                args += ["--resume", session_id]
            t0 = time.perf_counter()
            done = agent_clis.run("claude", *args, cwd=repo, env=claude_env, timeout=1800)
            wall = time.perf_counter() - t0
            requests, mark = served(log, mark, (*TURN_KEYS, *EXTRA_KEYS))
            got = claude_result(done)
            session_id = got.get("session_id") or session_id
            row = {"turn": i, "file": path, "attached": attach, "kind": q.kind, "answer": q.answer[:200],
                   "correct": got["ok"] and correct(q, full_reply(done)), "exit": done.returncode,
                   "wall_s": round(wall, 1), **got, "requests": requests,
                   "stderr_tail": done.stderr[-400:]}
            rows.append(row)
            logical = max((r.get("context_n") or 0 for r in row["requests"]), default=0)
            progress(f"claude_session: turn {i} ok={got['ok']} correct={row['correct']} logical={logical} "
                     f"requests={len(requests)} wall={wall:.0f}s")
            summary = summarize(rows, n_ctx)  # written after every turn: a stopped run keeps what it did
            write_result(out, "claude_session", {"seed": seed, "params": {"n_ctx": n_ctx, "limit": info.window,
                                                                          "clis": cli_versions(), "env": claude_env},
                                                 "summary": summary, "turns": rows},
                         {"target": engine.target, "speculator": engine.speculator})
            if logical >= 2 * n_ctx:
                break
    return summarize(rows, n_ctx)


def full_reply(done: subprocess.CompletedProcess[str]) -> str:
    """Claude Code's whole reply (``claude_result`` keeps its first 200 characters)."""
    try:
        return str(json.loads(done.stdout).get("result", ""))
    except ValueError:
        return ""


def summarize(rows: list[dict[str, Any]], n_ctx: int) -> dict[str, Any]:
    served_turns = [r for row in rows for r in row["requests"] if "refused" not in r]
    past = [r for r in served_turns if (r.get("context_n") or 0) > n_ctx]
    return {
        "turns": len(rows), "cli_ok": sum(r["ok"] for r in rows), "correct": sum(r["correct"] for r in rows),
        "requests": len(served_turns), "refused": sum("refused" in r for row in rows for r in row["requests"]),
        "logical_max": max((r.get("context_n") or 0 for r in served_turns), default=0),
        "physical_max": max((r.get("physical_n") or r.get("context_n") or 0 for r in served_turns), default=0),
        "past_window_requests": len(past), "evicting_requests": sum(bool(r.get("evicted_n")) for r in served_turns),
        "evicted_cells": sum(r.get("evicted_n") or 0 for r in served_turns),
        "reused_share_past_window": round(sum(r.get("cache_n") or 0 for r in past)
                                          / max(1, sum(r.get("context_n") or 0 for r in past)), 3),
    }
