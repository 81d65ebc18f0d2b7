"""``specgate bench stateless``: an agent session sent the way agent frameworks send it.

The official ``openai`` client streams every request with ``tools``; each long turn
is a question, the assistant's ``read_log`` call and the long log it returned (a
``role: tool`` message), and the last turn is a short instruction (the script of
bench/agent_session.py).  The same messages go to, each a fresh server:

- ``specgate_named``: SpecGate, the session named by ``X-SpecGate-Session``;
- ``specgate_stateless``: SpecGate, no session named: the client resends the whole
  history each turn, and the gateway finds the conversation by its tokens;
- ``llama_server``: llama.cpp's own server (its prompt cache on, one slot per agent);
- ``specgate_cluster_stateless``: two SpecGate replicas behind HAProxy with a real
  redis-server (``ops/cluster.sh``), no session named: the balancer routes on the API
  key, so each agent (its own key here) stays on one replica and keeps its reuse.

Every arm's servers are up for the whole run and the turns are interleaved: turn 1
in every arm, then turn 2 in every arm, and so on.  A turn's arms thus run minutes
apart, not a whole session apart, so a shared machine's drift in speed lands on all
of them alike.  Break-even is off in every SpecGate arm: it decides from the costs
each server times at start-up, and where SpecPrefill and dense cost about the same
(this pair on a 2-core CPU) that noise alone sent one arm dense and the others
sparse in the same run (89 s against 62 s on turn 1).  ``agents`` sessions run at
once in each arm, sharing the system prompt and tools (their logs differ).  Per turn: prompt tokens, tokens the server
reused (its ``timings.cache_n``), the client's TTFT (first streamed content or
tool-call delta; a tool call streams once it parses, so a call turn's TTFT includes
its decode) and the server's own (``timings.ttft_ms``: first token sampled).
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import statistics
from pathlib import Path
from typing import Any

from bench.agent_session import request, script
from bench.common import free_port, progress, write_result
from bench.serving import native_server_cmd, server, specgate_cmd
from core.config import EngineConfig

ARMS = ("specgate_named", "specgate_stateless", "llama_server", "specgate_cluster_stateless")
LONG_TOKENS = (3000, 3000)
QUICK_LONG_TOKENS = (600, 600)
# the server's per-model breakdown, to tell a slower turn's cause (scoring, selection, prefill)
TIMINGS = ("prompt_n", "kept_runs", "prompt_ms", "speculator_cache_n", "speculator_prefill_n",
           "speculator_prefill_ms", "speculator_mirrored_n", "lookahead_ms", "scoring_ms", "prefix_shared_n")
SYSTEM = "You are an operations agent. Use the tools; answer briefly."


class Agent:
    """One agent's conversation: its client, and the history it resends each turn."""

    def __init__(self, client: Any, turns: list[dict[str, Any]], label: str) -> None:
        self.client, self.turns, self.label = client, turns, label
        self.messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]

    async def step(self, i: int) -> dict[str, Any]:
        self.messages += self.turns[i]["append"]
        r = await request(self.client, self.messages)
        t = r["timings"] or {}
        cached = int(t.get("cache_n", 0))
        prompt = int(t.get("context_n") or (t.get("prompt_n", 0) + cached))
        progress(f"{self.label} turn {i + 1}: prompt {prompt} reused {cached} ttft {r['ttft_s']:.2f}s")
        reply: dict[str, Any] = {"role": "assistant", "content": r["answer"] or None}
        if r["tool_calls"]:
            reply["tool_calls"] = [{"id": f"call_r{i}_{k}", "type": "function", "function": c}
                                   for k, c in enumerate(r["tool_calls"])]
        self.messages.append(reply if reply["content"] or r["tool_calls"] else {"role": "assistant", "content": ""})
        return {"turn": i + 1, "prompt_tokens": prompt, "reused_tokens": cached,
                "ttft_s": round(r["ttft_s"], 3), "server_ttft_ms": t.get("ttft_ms"),
                "specprefill": t.get("specprefill"), "tool_calls": len(r["tool_calls"]),
                "predicted_n": t.get("predicted_n"), "total_s": round(r["total_s"], 3),
                "timings": {k: t.get(k) for k in TIMINGS}}


def command(arm: str, port: int, engine: EngineConfig, agents: int) -> list[str]:
    if arm == "llama_server":
        return native_server_cmd(port, EngineConfig(target=engine.target, speculator=engine.speculator,
                                                    n_ctx=engine.n_ctx, n_threads=engine.n_threads), agents)
    return specgate_cmd(port, engine, slots=max(agents, 1), break_even="false")


def keys(agents: int) -> list[str]:
    return [f"sk-bench-{a}" for a in range(agents)]  # one key per agent: the balancer spreads them


def start(stack: contextlib.ExitStack, arm: str, engine: EngineConfig, agents: int, logs: Path) -> str:
    """Start ``arm``'s server(s) for the ``stack``'s lifetime; its base URL."""
    progress(f"stateless: starting {arm}")
    if arm == "specgate_cluster_stateless":
        return str(stack.enter_context(cluster(engine, keys(agents), logs)).base)
    port = free_port()
    return stack.enter_context(server(command(arm, port, engine, agents), port,
                                      logs / f"stateless_{arm}_{agents}.log"))


def cluster(engine: EngineConfig, keys: list[str], logs: Path) -> contextlib.AbstractContextManager[Any]:
    """Two replicas of the pair behind HAProxy, their logs under ``logs``."""
    from bench.cluster import running

    folder = logs / "stateless_cluster"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    return running(folder, 2, {"SPECGATE_TARGET": engine.target, "SPECGATE_SPECULATOR": engine.speculator,
                               "SPECGATE_N_CTX": str(engine.n_ctx), "SPECGATE_API_KEYS": ",".join(keys),
                               "SPECGATE_SLOTS": str(len(keys)), "SPECGATE_BREAK_EVEN": "false"})


def agent(client: Any, arm: str, r: int, a: int, sizes: tuple[int, ...]) -> Agent:
    """Round ``r``'s agent ``a`` of ``arm``: a named arm sends its session id, the others none."""
    headers = {"X-SpecGate-Session": f"bench-{arm}-{r}-{a}"} if arm.endswith("named") else {}
    return Agent(client.with_options(default_headers=headers), script(sizes, seed=11 + a + 100 * r), f"{arm}-{r}-{a}")


async def interleaved(bases: dict[str, str], agents: int, sizes: tuple[int, ...], on_turn: Any,
                      repeats: int = 1) -> dict[str, dict[str, Any]]:
    """Each turn in every arm before the next turn; ``on_turn(results)`` after each.
    ``repeats`` rounds of ``agents`` new conversations each (other logs), one round after another."""
    import openai

    results: dict[str, dict[str, Any]] = {arm: {"agents": []} for arm in bases}
    async with contextlib.AsyncExitStack() as stack:
        clients: dict[tuple[str, int], Any] = {}
        for arm, base in bases.items():
            for a, key in enumerate(keys(agents)):
                clients[arm, a] = await stack.enter_async_context(openai.AsyncOpenAI(
                    base_url=base + "/v1", api_key=key, max_retries=0, timeout=3600))
        for r in range(repeats):
            # same system prompt and tools, different logs (seeds): what N agents of one framework send
            crowd = {arm: [agent(clients[arm, a], arm, r, a, sizes) for a in range(agents)] for arm in bases}
            for arm in bases:
                results[arm]["agents"] += [[] for _ in range(agents)]
            for i in range(len(next(iter(crowd.values()))[0].turns)):
                for arm, group in crowd.items():
                    rows = await asyncio.gather(*(ag.step(i) for ag in group))
                    for a, row in enumerate(rows):
                        results[arm]["agents"][r * agents + a].append(row)
                on_turn(results)
    return results


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for arm, res in results.items():
        n_turns = max((len(c) for c in res["agents"]), default=0)
        # turn -> every conversation's row (a round still running has fewer turns)
        per_turn = [tuple(c[i] for c in res["agents"] if len(c) > i) for i in range(n_turns)]
        out[arm] = [{"turn": rows[0]["turn"],
                     "prompt_tokens": round(statistics.mean(r["prompt_tokens"] for r in rows)),
                     "reused_tokens": round(statistics.mean(r["reused_tokens"] for r in rows)),
                     "ttft_s": round(statistics.mean(r["ttft_s"] for r in rows), 2),
                     "ttft_median_s": round(statistics.median(r["ttft_s"] for r in rows), 2),
                     "server_ttft_s": server_ttft(rows)} for rows in per_turn]
    named = out.get("specgate_named")
    for arm, turns in out.items():
        if named and arm != "specgate_named":
            for t, n in zip(turns, named, strict=False):
                t["ttft_vs_named"] = round(t["ttft_s"] / n["ttft_s"], 2) if n["ttft_s"] else None
                if t["server_ttft_s"] and n["server_ttft_s"]:
                    t["server_ttft_vs_named"] = round(t["server_ttft_s"] / n["server_ttft_s"], 2)
    return out


def server_ttft(rows: tuple[dict[str, Any], ...]) -> float | None:
    ms = [r["server_ttft_ms"] for r in rows if r.get("server_ttft_ms") is not None]
    return round(statistics.mean(ms) / 1000, 2) if len(ms) == len(rows) else None


def run(engine: EngineConfig, quick: bool, out: Path, arms: tuple[str, ...] = ARMS, agents: int = 1,
        repeats: int = 1) -> dict[str, Any]:
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, not {repeats}")
    sizes = QUICK_LONG_TOKENS if quick else LONG_TOKENS
    engine = EngineConfig(target=engine.target, speculator=engine.speculator, scorer=engine.scorer,
                          n_ctx=8192 if quick else 12288,
                          n_threads=engine.n_threads)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)

    def save(results: dict[str, dict[str, Any]]) -> None:
        write_result(out, "stateless", {"long_tokens": sizes, "agents": agents, "repeats": repeats,
                                        "n_ctx": engine.n_ctx, "interleaved": True, "arms": results,
                                        "summary": summarize(results)},
                     {"target": engine.target, "speculator": engine.speculator})

    with contextlib.ExitStack() as stack:
        bases = {arm: start(stack, arm, engine, agents, logs) for arm in arms}
        progress(f"stateless: {', '.join(arms)} up; {agents} agent(s) each, turns interleaved")
        results = asyncio.run(interleaved(bases, agents, sizes, save, repeats))
    return summarize(results)
