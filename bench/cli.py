"""``specgate bench``: run the benchmark scenarios, write JSON results and PNG plots.

    specgate bench                       # all scenarios, full sizes
    specgate bench --quick               # a few minutes
    specgate bench first_turn --lengths 1024,2048
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from core import model_files
from core.config import EngineConfig, PrefillPolicy, build
from core.errors import ConfigError

SCENARIOS = ("first_turn", "multi_turn", "overhead", "topp", "planner", "soak", "fuzz", "failover", "concurrency",
             "long_prefill", "scorers", "constrained")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("scenarios", nargs="*", default=[],
                        help=f"which to run: {', '.join(SCENARIOS)} (default: the first three)")
    parser.add_argument("--quick", action="store_true", help="small sizes: a few minutes in all")
    parser.add_argument("--lengths", help="first_turn, planner and scorers prompt lengths, comma-separated tokens")
    parser.add_argument("--out", default="results/bench", help="results folder")
    parser.add_argument("--arms", help="multi_turn, concurrency or long_prefill arms to (re)run, comma-separated "
                        "(default: all)")
    parser.add_argument("--sessions", help="concurrency levels, comma-separated (default: 1,2,4,8,12; quick 1,2,4)")
    parser.add_argument("--stagger", action="store_true",
                        help="concurrency: one session runs alone first, then the others start together")
    parser.add_argument("--scorers", default="", help="scorers: the arms besides today's, as scorer/agg, e.g. "
                        "target-early:9/filter-sum,speculator-early:8/max")
    parser.add_argument("--target", default=None)
    parser.add_argument("--speculator", default=None)


def run(args: argparse.Namespace) -> int:
    import orjson  # the bench extras are needed only from here on

    from bench import first_turn, plots, serving
    from bench.common import progress
    from bench.derived_models import derived

    out = Path(args.out)
    suffix = "_quick" if args.quick else ""
    built = model_files.with_default_models(build(EngineConfig, {"target": args.target,
                                                                 "speculator": args.speculator}))
    engine = EngineConfig(target=built.target, speculator=built.speculator, n_threads=built.n_threads)
    chosen = args.scenarios or list(SCENARIOS[:3])
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        raise ConfigError(f"unknown scenario(s) {sorted(unknown)}; known: {', '.join(SCENARIOS)}")
    summaries: dict[str, Any] = {}
    if "first_turn" in chosen:
        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
            ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192])
        rows = first_turn.run(engine, build(PrefillPolicy), lengths, out / f"first_turn{suffix}.json")
        plots.first_turn(rows, out / f"first_turn{suffix}.png")
        summaries["first_turn"] = rows
    if "multi_turn" in chosen:
        from bench import agent_session

        arms = tuple(args.arms.split(",")) if args.arms else agent_session.ARMS
        if set(arms) - set(agent_session.ARMS):
            raise ConfigError(f"unknown arm(s); known: {', '.join(agent_session.ARMS)}")
        s = agent_session.run(engine, args.quick, out / f"agent_session{suffix}.json", arms)
        plots.agent_session(s, out / f"agent_session{suffix}.png")
        summaries["multi_turn"] = s
    if "overhead" in chosen:
        path = out / f"overhead{suffix}.json"
        s = serving.overhead(str(derived(3)), str(derived(2)), args.quick, path)
        doc = orjson.loads(path.read_bytes())
        plots.overhead(doc["overhead_ms"], s["concurrency"], out / f"overhead{suffix}.png")
        summaries["overhead"] = s
    if "planner" in chosen:
        from bench import planner

        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
            ([1024, 2048] if args.quick else [1024, 2048, 4096, 8192, 12288])
        rows = planner.run(engine, build(PrefillPolicy), lengths, out / f"planner{suffix}.json")
        plots.planner(rows, out / f"planner{suffix}.png")
        summaries["planner"] = planner.summary(rows)
    if "soak" in chosen:
        from bench import soak

        sessions, turns = (20, 5) if args.quick else (100, 10)
        s = soak.run(str(derived(3)), str(derived(2)), out / f"soak{suffix}.json", sessions, turns)
        plots.soak(orjson.loads((out / f"soak{suffix}.json").read_bytes())["samples"], out / f"soak{suffix}.png")
        summaries["soak"] = s
    if "fuzz" in chosen:
        from bench import fuzz

        summaries["fuzz"] = fuzz.run(str(derived(3)), str(derived(2)), out / f"fuzz{suffix}.json",
                                     20 if args.quick else 200)
    if "failover" in chosen:
        from bench import failover

        summaries["failover"] = failover.run(str(derived(3)), str(derived(2)), out / f"failover{suffix}.json",
                                             *((6, 4) if args.quick else (20, 6)))
    if "concurrency" in chosen:
        from bench import concurrency

        arms = tuple(args.arms.split(",")) if args.arms else concurrency.ARMS
        if set(arms) - set(concurrency.ARMS):
            raise ConfigError(f"unknown arm(s); known: {', '.join(concurrency.ARMS)}")
        levels = tuple(int(x) for x in args.sessions.split(",")) if args.sessions else None
        name = f"concurrency{'_stagger' if args.stagger else ''}{suffix}"
        rows = concurrency.run(engine, args.quick, out / f"{name}.json", arms, levels, args.stagger)
        plots.concurrency(rows, out / f"{name}.png")
        summaries["concurrency"] = [{k: v for k, v in r.items() if k != "rows"} for r in rows]
    if "long_prefill" in chosen:
        from bench import long_prefill

        arms = tuple(args.arms.split(",")) if args.arms else long_prefill.ARMS
        if set(arms) - set(long_prefill.ARMS):
            raise ConfigError(f"unknown arm(s); known: {', '.join(long_prefill.ARMS)}")
        results = long_prefill.run(engine, args.quick, out / f"long_prefill{suffix}.json", arms)
        plots.long_prefill(results, out / f"long_prefill{suffix}.png")
        summaries["long_prefill"] = results
    if "scorers" in chosen:
        from bench import scorers

        lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else \
            ([1024] if args.quick else [4096, 8192])
        summary = scorers.run(engine, build(PrefillPolicy), lengths, scorers.parse_arms(args.scorers),
                              out / f"scorers{suffix}.json")
        plots.scorers_ttft(summary, out / f"scorers{suffix}.png")
        summaries["scorers"] = summary
    if "constrained" in chosen:
        from bench import constrained

        s = constrained.run(engine, args.quick, out / f"constrained{suffix}.json")
        plots.constrained(s, out / f"constrained{suffix}.png")
        summaries["constrained"] = s
    if "topp" in chosen:
        from bench import topp
        summaries["topp"] = topp.run(out / f"topp{suffix}.json")
    progress("done")
    print(orjson.dumps(summaries, option=orjson.OPT_INDENT_2).decode())
    return 0
