"""``specgate bench``: run the benchmark scenarios, write JSON results and PNG plots.

    specgate bench                       # all scenarios, full sizes
    specgate bench --quick               # a few minutes
    specgate bench first_turn --lengths 1024,2048
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.config import EngineConfig
from core.errors import ConfigError
from core.loader import build
from core.policies import PrefillPolicy

SCENARIOS = ("first_turn", "multi_turn", "overhead", "topp", "planner", "soak", "fuzz", "failover", "concurrency",
             "long_prefill", "scorers", "constrained", "stateless", "clients", "agent_scale", "depth",
             "coding_agents", "fresh_start", "decode_copy", "long_session", "claude_session")
EXTRA_HINT = "the benchmarks need the bench extra: .venv/bin/pip install -e '.[bench]'"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenarios", nargs="*", default=[],
                        help=f"which to run: {', '.join(SCENARIOS)} (default: the first three)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a few minutes in all")
    parser.add_argument("--lengths", help="first_turn, planner, scorers and decode_copy prompt lengths, "
                        "comma-separated tokens")
    parser.add_argument("--content", default="logs",
                        help="planner: what the tool result holds, logs and/or code, comma-separated (default logs)")
    parser.add_argument("--out", default="results/bench", help="results folder")
    parser.add_argument("--arms", help="multi_turn, concurrency, long_prefill or stateless arms, clients' "
                        "clients, or agent_scale's backends, to (re)run, comma-separated (default: all)")
    parser.add_argument("--stateless", action="store_true",
                        help="soak: clients name no session and resend their history (implicit sessions)")
    parser.add_argument("--responses", action="store_true",
                        help="soak: stored Responses chains with 30 tools, beside a count_tokens flood")
    parser.add_argument("--turns", type=int, default=None,
                        help="soak: turns per session (default 10; quick 5); claude_session: Claude Code turns at "
                        "most (default 12)")
    parser.add_argument("--two-keys", action="store_true",
                        help="soak: two API keys' agents side by side, every slot's cells checked for the other "
                        "key's canary (issue 51)")
    parser.add_argument("--minutes", type=float, default=None, help="soak --two-keys: how long (default 20; quick 2)")
    parser.add_argument("--repeats", type=int, default=1,
                        help="stateless: rounds of new conversations, one after another (default 1)")
    parser.add_argument("--agents", type=int, default=1, help="stateless: agents at once (default 1)")
    parser.add_argument("--agent-bodies", action="store_true",
                        help="failover: the agent arm (~80 KB streamed Anthropic and Responses bodies)")
    parser.add_argument("--sessions", help="concurrency levels, comma-separated (default: 1,2,4,8,12; quick 1,2,4)")
    parser.add_argument("--stagger", action="store_true",
                        help="concurrency: one session runs alone first, then the others start together")
    parser.add_argument("--scorers", default="", help="scorers: the arms besides today's, as scorer/agg, e.g. "
                        "target-early:9/filter-sum,speculator-early:8/max")
    parser.add_argument("--kv-layout", choices=("split", "unified"), default="split",
                        help="coding_agents, depth and soak --two-keys: the server's KV layout (default split; "
                        "unified writes coding_agents_unified.json, depth_unified.json)")
    parser.add_argument("--n-ctx", type=int, default=0,
                        help="long_session: the KV window (default: the target's trained context, 32K); "
                        "claude_session: the replica's window (default 20480)")
    parser.add_argument("--target", default=None)
    parser.add_argument("--speculator", default=None)
    parser.add_argument("--scorer", default=None,
                        help="the engine's scoring model, as specgate serve --scorer (default speculator-q4_0)")


@dataclass(slots=True, frozen=True)
class Run:
    """What every scenario gets: the parsed flags, the pair, where to write, and a name suffix."""

    args: argparse.Namespace
    engine: EngineConfig
    out: Path
    suffix: str

    @property
    def quick(self) -> bool:
        return bool(self.args.quick)

    def path(self, name: str, ext: str = "json") -> Path:
        return self.out / f"{name}{self.suffix}.{ext}"

    def lengths(self, quick: list[int], full: list[int]) -> list[int]:
        return [int(x) for x in self.args.lengths.split(",")] if self.args.lengths else (quick if self.quick else full)

    def arms(self, known: tuple[str, ...]) -> tuple[str, ...]:
        arms = tuple(self.args.arms.split(",")) if self.args.arms else known
        if set(arms) - set(known):
            raise ConfigError(f"unknown arm(s); known: {', '.join(known)}")
        return arms


def _tiny() -> tuple[str, str]:
    from core.models.scorer_cuts import derived

    return str(derived(3)), str(derived(2))


def first_turn(r: Run) -> Any:
    from bench import first_turn, plots

    rows = first_turn.run(r.engine, build(PrefillPolicy), r.lengths([1024, 2048], [1024, 2048, 4096, 8192]),
                          r.path("first_turn"))
    plots.first_turn(rows, r.path("first_turn", "png"))
    return rows


def multi_turn(r: Run) -> Any:
    from bench import agent_session, plots

    s = agent_session.run(r.engine, r.quick, r.path("agent_session"), r.arms(agent_session.ARMS))
    plots.agent_session(s, r.path("agent_session", "png"))
    return s


def overhead(r: Run) -> Any:
    import orjson

    from bench import plots, serving

    s = serving.overhead(*_tiny(), r.quick, r.path("overhead"))
    plots.overhead(orjson.loads(r.path("overhead").read_bytes())["overhead_ms"], s["concurrency"],
                   r.path("overhead", "png"))
    return s


def planner(r: Run) -> Any:
    from bench import planner, plots

    out = {}
    for content in r.args.content.split(","):
        if content not in planner.CONTENTS:
            raise SystemExit(f"--content must name {' or '.join(planner.CONTENTS)}, got {content!r}")
        name = "planner" if content == "logs" else f"planner_{content}"
        rows = planner.run(r.engine, build(PrefillPolicy), r.lengths([1024, 2048], [1024, 2048, 4096, 8192, 12288]),
                           r.path(name), content)
        plots.planner(rows, r.path(name, "png"))
        out[content] = planner.summary(rows)
    return out


def soak(r: Run) -> Any:
    import orjson

    from bench import plots, soak

    if r.args.two_keys:
        from bench import soak_keys

        minutes = r.args.minutes or (2.0 if r.quick else 20.0)
        suffix = "" if r.args.kv_layout == "split" else f"_{r.args.kv_layout}"
        return soak_keys.run(*_tiny(), r.path(f"soak_two_keys{suffix}"), minutes, r.args.kv_layout)
    sessions, turns = (20, 5) if r.quick else (100, 10)
    turns = r.args.turns or turns
    name = "soak_responses" if r.args.responses else "soak_stateless" if r.args.stateless else "soak"
    s = soak.run(*_tiny(), r.path(name), sessions, turns, r.args.stateless, r.args.responses)
    plots.soak(orjson.loads(r.path(name).read_bytes())["samples"], r.path(name, "png"))
    return s


def fuzz(r: Run) -> Any:
    from bench import fuzz

    return fuzz.run(*_tiny(), r.path("fuzz"), 20 if r.quick else 200)


def failover(r: Run) -> Any:
    from bench import failover, failover_agents

    if r.args.agent_bodies:
        return failover_agents.run(*_tiny(), r.path("failover_agents"), *((4, 3) if r.quick else (8, 4)))
    return failover.run(*_tiny(), r.path("failover"), *((6, 4) if r.quick else (20, 6)))


def concurrency(r: Run) -> Any:
    from bench import concurrency, plots

    levels = tuple(int(x) for x in r.args.sessions.split(",")) if r.args.sessions else None
    name = f"concurrency{'_stagger' if r.args.stagger else ''}"
    rows = concurrency.run(r.engine, r.quick, r.path(name), r.arms(concurrency.ARMS), levels, r.args.stagger)
    plots.concurrency(rows, r.path(name, "png"))
    return [{k: v for k, v in row.items() if k != "rows"} for row in rows]


def long_prefill(r: Run) -> Any:
    from bench import long_prefill, plots

    results = long_prefill.run(r.engine, r.quick, r.path("long_prefill"), r.arms(long_prefill.ARMS))
    plots.long_prefill(results, r.path("long_prefill", "png"))
    return results


def scorers(r: Run) -> Any:
    from bench import plots, scorers

    summary = scorers.run(r.engine, build(PrefillPolicy), r.lengths([1024], [4096, 8192]),
                          scorers.parse_arms(r.args.scorers), r.path("scorers"))
    plots.scorers_ttft(summary, r.path("scorers", "png"))
    return summary


def topp(r: Run) -> Any:
    from bench import topp

    return topp.run(r.path("topp"))


def constrained(r: Run) -> Any:
    from bench import constrained, plots

    s = constrained.run(r.engine, r.quick, r.path("constrained"))
    plots.constrained(s, r.path("constrained", "png"))
    return s


def stateless(r: Run) -> Any:
    from bench import plots, stateless

    name = f"stateless_{r.args.agents}agents"
    s = stateless.run(r.engine, r.quick, r.path(name), r.arms(stateless.ARMS), r.args.agents,
                      r.args.repeats)
    plots.stateless(s, r.path(name, "png"))
    return s


def clients(r: Run) -> Any:
    from bench import clients

    return clients.run(r.engine, r.path("clients"), r.arms(tuple(clients.CLIENTS)))


def agent_scale(r: Run) -> Any:
    from bench import agent_scale, plots

    arms = r.arms(agent_scale.BACKENDS)
    name = "agent_scale" if arms == agent_scale.BACKENDS else "_".join(("agent_scale", *arms))
    s = agent_scale.run(r.engine, r.path(name), arms)
    plots.agent_scale(s, r.path(name, "png"))
    return s


def coding_agents(r: Run) -> Any:
    from bench import coding_agents

    return coding_agents.run(r.engine, r.path(laid_out("coding_agents", r)), r.args.kv_layout)


def depth(r: Run) -> Any:
    from bench import depth, plots

    s = depth.run(r.engine, r.path(laid_out("depth", r)), r.args.kv_layout)
    plots.depth(s, r.path(laid_out("depth", r), "png"))
    return s


def long_session(r: Run) -> Any:
    from bench import long_session

    return long_session.run(r.engine, r.path(f"long_session_{r.args.n_ctx}" if r.args.n_ctx else "long_session"),
                            r.quick, r.arms(long_session.ARMS), n_ctx=r.args.n_ctx)


def claude_session(r: Run) -> Any:
    from bench import claude_session

    n_ctx = r.args.n_ctx or claude_session.N_CTX
    return claude_session.run(r.engine, r.path(f"claude_session_{n_ctx}"), r.args.turns or 12, n_ctx)


def decode_copy(r: Run) -> Any:
    from bench import decode_copy

    return decode_copy.run(r.engine, r.path("decode_copy"), tuple(r.lengths([4096], [4096, 20480])),
                           arms=r.arms(tuple(decode_copy.ARMS)))


def fresh_start(r: Run) -> Any:
    from bench import fresh_start

    return fresh_start.run(r.engine, r.path("fresh_start"))


def laid_out(name: str, r: Run) -> str:
    """A result's name, with the KV layout when it is not the default."""
    return name if r.args.kv_layout == "split" else f"{name}_{r.args.kv_layout}"


REGISTRY: dict[str, Callable[[Run], Any]] = {
    "first_turn": first_turn, "multi_turn": multi_turn, "overhead": overhead, "topp": topp, "planner": planner,
    "soak": soak, "fuzz": fuzz, "failover": failover, "concurrency": concurrency, "long_prefill": long_prefill,
    "scorers": scorers, "constrained": constrained, "stateless": stateless, "clients": clients,
    "agent_scale": agent_scale, "depth": depth, "coding_agents": coding_agents, "fresh_start": fresh_start,
    "decode_copy": decode_copy, "long_session": long_session, "claude_session": claude_session,
}


def run(args: argparse.Namespace) -> int:
    try:
        import matplotlib  # noqa: F401  (the bench extra: plots, and llama_cpp.server for its arms)
        import orjson
    except ModuleNotFoundError as exc:
        raise ConfigError(f"{EXTRA_HINT} (missing: {exc.name})") from None
    from bench.common import progress

    chosen = args.scenarios or list(SCENARIOS[:3])
    if unknown := set(chosen) - set(REGISTRY):
        raise ConfigError(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    from bench.common import bench_engine

    engine = bench_engine(target=args.target, speculator=args.speculator, scorer=args.scorer)
    r = Run(args, engine, Path(args.out), "_quick" if args.quick else "")
    summaries = {name: REGISTRY[name](r) for name in SCENARIOS if name in chosen}
    progress("done")
    print(orjson.dumps(summaries, option=orjson.OPT_INDENT_2).decode())
    return 0
