"""``specgate bench coding_agents``: the three coding agents, unchanged, headless against the
pair a user gets by default, through the deployment ``ops/cluster.sh`` starts (redis-server,
one replica, HAProxy in front; the KV tier in a folder of its own).  One run:

1. ``claude_first``: ``claude -p`` in a scratch git repository, cold;
2. ``claude_sibling``: a second ``claude -p`` conversation there, a new task (its billing line
   differs, the rest of its 12K-token prefix does not);
3. ``claude_resumed``: ``claude -p --resume`` of the first conversation;
4. ``codex_first`` and ``codex_second``: two ``codex exec`` threads;
5. ``opencode``: ``opencode run`` (its title request and its turn, sent at once).

For each: the CLI's exit and reply, its wall time, and from the replica's log every request
it served: route, prompt tokens, tokens reused and prefilled, TTFT, and refusals.  The 1.5B
target is a weak agent: whether a reply is useful is recorded, not judged.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench import agent_clis
from bench.cluster import running
from bench.common import bench_engine, progress, write_result
from core.config import EngineConfig

TURN_KEYS = ("context_n", "cache_n", "prompt_n", "prefix_shared_n", "ttft_ms", "finish", "predicted_n",
             "specprefill", "decode_mode")


def served(log: Path, mark: int, keys: tuple[str, ...] = TURN_KEYS) -> tuple[list[dict[str, Any]], int]:
    """The requests the replica served since line ``mark`` of its log (``keys`` of each), and
    the line count now."""
    lines = log.read_text(errors="replace").splitlines()
    evs = agent_clis.json_lines("\n".join(lines[mark:]))
    starts = {e["request_id"]: e for e in evs if e.get("event") == "request_start"}
    rows = [{"route": starts.get(e["request_id"], {}).get("path"),
             "tools": starts.get(e["request_id"], {}).get("tools"), **{k: e.get(k) for k in keys}}
            for e in evs if e.get("event") == "turn_done"]
    refused = [{k: e.get(k) for k in ("path", "status", "code", "error")}
               for e in evs if e.get("event") == "request_error"]
    return [*rows, *({"refused": r} for r in refused)], len(lines)


def claude_result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    doc = json.loads(done.stdout) if done.stdout.startswith("{") else {}
    usage = doc.get("usage", {})
    return {"ok": done.returncode == 0 and doc.get("is_error") is False, "reply": str(doc.get("result", ""))[:200],
            "num_turns": doc.get("num_turns"), "session_id": doc.get("session_id"),
            "client_usage": {k: usage.get(k) for k in ("input_tokens", "cache_read_input_tokens", "output_tokens")}}


def codex_result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = agent_clis.json_lines(done.stdout)
    kinds = [x.get("type") for x in lines]
    usage: dict[str, Any] = next((x.get("usage", {}) for x in lines if x.get("type") == "turn.completed"), {})
    return {"ok": done.returncode == 0 and "turn.completed" in kinds and "turn.failed" not in kinds,
            "reply": agent_clis.codex_reply(lines)[:200], "client_usage": usage}


def opencode_result(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    return {"ok": done.returncode == 0 and "error" not in done.stdout.lower(), "reply": done.stdout.strip()[-200:]}


def run(engine: EngineConfig, out: Path, kv_layout: str = "split") -> dict[str, Any]:
    if gone := agent_clis.missing():
        raise RuntimeError(f"{gone} missing: `bash ops/setup.sh --test` installs the agent CLIs")
    work = Path(tempfile.mkdtemp(prefix="specgate-coding-agents-"))
    env = {"SPECGATE_TARGET": engine.target, "SPECGATE_SPECULATOR": engine.speculator,
           "SPECGATE_KV_TIER_DIR": str(work / "tier"), "SPECGATE_LOG_LEVEL": "info", "SPECGATE_KV_LAYOUT": kv_layout}
    arms: list[dict[str, Any]] = []
    with running(work / "cluster", 1, env) as cluster:
        log, mark = cluster.dir / "replica-1.log", 0
        n_ctx = int(httpx.get(cluster.base + "/v1/models", timeout=30).json()["data"][0]["context_length"])
        claude_repo = agent_clis.scratch_repo(work / "claude")
        codex_repo = agent_clis.scratch_repo(work / "codex")
        opencode_repo = agent_clis.scratch_repo(work / "opencode")

        def arm(name: str, go: Callable[[], subprocess.CompletedProcess[str]],
                parse: Callable[[subprocess.CompletedProcess[str]], dict[str, Any]]) -> dict[str, Any]:
            nonlocal mark
            progress(f"coding_agents: {name}")
            t0 = time.perf_counter()
            done = go()
            wall = time.perf_counter() - t0
            requests, mark = served(log, mark)
            result = {"arm": name, "exit": done.returncode, "wall_s": round(wall, 1), **parse(done),
                      "requests": requests, "stderr_tail": done.stderr[-600:]}
            arms.append(result)
            return result

        base = cluster.base
        first = arm("claude_first", lambda: agent_clis.claude(base, claude_repo, "Reply with one word: hello"),
                    claude_result)
        arm("claude_sibling", lambda: agent_clis.claude(base, claude_repo, "Reply with one word: hi"), claude_result)
        arm("claude_resumed", lambda: agent_clis.claude(base, claude_repo, "Now reply with one word: bye",
                                                        "--resume", str(first["session_id"])), claude_result)
        arm("codex_first", lambda: agent_clis.codex(base, codex_repo, "Reply with one word: hello", n_ctx),
            codex_result)
        arm("codex_second", lambda: agent_clis.codex(base, codex_repo, "Reply with one word: hi", n_ctx),
            codex_result)
        arm("opencode", lambda: agent_clis.opencode(base, opencode_repo, "Reply with one word: hello", n_ctx),
            opencode_result)
    return summarize(arms, n_ctx, kv_layout, out, engine)


def summarize(arms: list[dict[str, Any]], n_ctx: int, kv_layout: str, out: Path,
              engine: EngineConfig) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for a in arms:
        turns = [r for r in a["requests"] if "refused" not in r]
        # the agent's turn (not opencode's title request)
        main: dict[str, Any] = max(turns, key=lambda r: r.get("context_n") or 0, default={})
        prompt = main.get("context_n") or 0
        summary[a["arm"]] = {
            "ok": a["ok"], "wall_s": a["wall_s"], "requests": len(turns),
            "refused": sum("refused" in r for r in a["requests"]), "prompt": prompt,
            "reused": main.get("cache_n"), "ttft_s": round((main.get("ttft_ms") or 0) / 1e3, 1),
            "cached_share": round((main.get("cache_n") or 0) / prompt, 3) if prompt else None,
            "reply": a.get("reply", "")[:60]}
    write_result(out, "coding_agents", {"params": {"n_ctx": n_ctx, "kv_layout": kv_layout,
                                                   "deployment": "ops/cluster.sh up 1 (HAProxy)",
                                                   "clis": cli_versions()},
                                        "summary": summary, "arms": arms},
                 {"target": engine.target, "speculator": engine.speculator})
    return summary


def cli_versions() -> dict[str, str]:
    """The installed versions (``.clis/package.json`` pins ranges)."""
    modules = agent_clis.ROOT / ".clis" / "node_modules"
    names = orjson.loads((modules.parent / "package.json").read_bytes())["dependencies"]
    return {n: orjson.loads((modules / n / "package.json").read_bytes())["version"] for n in names}


if __name__ == "__main__":  # without the bench extra: python -m bench.coding_agents OUT.json
    print(orjson.dumps(run(bench_engine(), Path(sys.argv[1])), option=orjson.OPT_INDENT_2).decode())
