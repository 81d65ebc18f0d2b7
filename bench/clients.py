"""``specgate bench clients``: where each agent client's resent history stops matching.

Each client, unchanged and pointed at ``base_url``, holds a short tool-using conversation
and names no session, as it does by default: it resends the whole history on every
request, re-serialized its own way, and the gateway finds the conversation by its tokens
(implicit sessions).  The match runs to the first token where the client's copy of the
history renders differently from what the gateway holds (the prompt and the reply of the
request before), so per request this records:

- ``held``: the tokens the previous request left in the KV (its prompt plus its reply);
- ``reused``: the tokens this request took from it (the gateway's ``timings.cache_n``);
- ``lost``: ``held - reused``, the tail of the held conversation the client's copy did not
  match (0 when the client resent exactly what the template rendered).

Figures come from the gateway's own ``turn_done`` log lines, so every client is counted
the same way.  Each client gets its own API key (implicit sessions never cross keys);
two plain ``openai`` agents then run at once under one key, each on its own conversation,
to show that concurrent stateless conversations do not take each other's KV.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import orjson

from bench import client_scripts
from bench.common import free_port, progress, write_result
from bench.serving import server, specgate_cmd
from core.config import EngineConfig

CLIENTS: dict[str, Callable[[str, str], Awaitable[Any]]] = {
    "openai": client_scripts.openai_chat,
    "langchain": client_scripts.langchain,
    "langgraph": client_scripts.langgraph,
    "pydantic_ai": client_scripts.pydantic_ai,
    "instructor": client_scripts.instructor,
    "litellm": client_scripts.litellm,
    "openai_agents": client_scripts.openai_agents,
    "anthropic": client_scripts.anthropic,
}


def turn_lines(log: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    """The ``turn_done`` events the gateway logged after byte ``start`` of its log."""
    with log.open("rb") as fh:
        fh.seek(start)
        data = fh.read()
    events = []
    for line in data.splitlines():
        with contextlib.suppress(orjson.JSONDecodeError):
            event = orjson.loads(line)
            if isinstance(event, dict) and event.get("event") == "turn_done":
                events.append(event)
    return events, start + len(data)


def match_rows(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per request: what it sent, what it reused of what the request before held."""
    rows: list[dict[str, Any]] = []
    held = 0
    for i, e in enumerate(events):
        prompt, reused, reply = int(e["context_n"]), int(e["cache_n"]), int(e["predicted_n"])
        rows.append({"request": i + 1, "prompt_tokens": prompt, "held": held, "reused": reused,
                     "lost": max(held - reused, 0) if i else None, "reply_tokens": reply,
                     "reused_share_of_held": round(reused / held, 3) if held else None,
                     "ttft_ms": e.get("ttft_ms"), "finish": e.get("finish")})
        held = prompt + reply
    return rows


async def run_client(name: str, base: str, log: Path, offset: int) -> tuple[dict[str, Any], int]:
    error = None
    try:
        await CLIENTS[name](base, key_of(name))
    except Exception as exc:  # a client that fails is reported, not fatal to the others
        error = f"{type(exc).__name__}: {exc}"[:300]
    events, offset = turn_lines(log, offset)
    rows = match_rows(events)
    later = [r for r in rows[1:] if r["held"]]
    progress(f"{name}: {len(rows)} requests, lost per later request {[r['lost'] for r in later]}"
             + (f" ({error})" if error else ""))
    return {"requests": rows, "error": error,
            "min_share": min((r["reused_share_of_held"] for r in later), default=None)}, offset


def key_of(name: str) -> str:
    return f"sk-bench-{name}"


def run(engine: EngineConfig, out: Path, names: tuple[str, ...]) -> dict[str, Any]:
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / "clients_specgate.log"
    port = free_port()
    results: dict[str, Any] = {}
    models = {"target": engine.target, "speculator": engine.speculator}
    keys = ",".join(key_of(n) for n in (*names, "together"))  # one tenant per client: no match across them

    async def all_clients(base: str) -> None:
        # one event loop for all: some clients (langchain-openai) cache their HTTP client per process
        offset = log.stat().st_size
        for name in names:
            progress(f"clients: {name}")
            results[name], offset = await run_client(name, base, log, offset)
            write_result(out, "clients", {"n_ctx": engine.n_ctx, "clients": results}, models)
        progress("clients: two openai agents at once, one key")
        results["together"] = await client_scripts.two_at_once(base, key_of("together"))

    with server(specgate_cmd(port, engine, slots=2, log_level="info"), port, log,
                env={"SPECGATE_API_KEYS": keys}) as base:
        asyncio.run(all_clients(base))
    summary = {name: r["min_share"] for name, r in results.items()}
    write_result(out, "clients", {"n_ctx": engine.n_ctx, "clients": results, "summary": summary}, models)
    return summary
