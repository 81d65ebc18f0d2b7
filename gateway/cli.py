"""The ``specgate`` console script: one parser, one subcommand per tool.

Every option defaults to None so that core.config.build applies the one
documented precedence: flag > SPECGATE_* environment variable > default.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from typing import Any

from core.config import EngineConfig, GatewayConfig, PolicyConfig, SamplingParams, field_default
from core.errors import SpecGateError

POLICY_HELP = {
    "enabled": "run SpecPrefill at all",
    "lookahead": "greedy speculator steps scored after the last prompt token",
    "pool_kernel": "mean-pool width along tokens (0/1 = off)",
    "select_mode": "mass | chunk",
    "mass": "mass mode: keep chunks until this share of the score",
    "keep_fraction": "chunk mode: fraction of chunks kept",
    "max_keep": "cap on kept tokens (0 = none), lowest chunks dropped first",
    "position_mode": "original (bridge) | compact",
    "min_tokens": "prompts shorter than this skip scoring",
    "break_even": "skip when scoring would cost more than it saves",
    "safety": "break-even safety factor",
    "guard_mode": "skip | conservative (keep system/tool spans dense)",
    "speculative": "speculative decoding: the speculator drafts, the target verifies",
    "specattn": "speculative decoding with SpecAttn sparse verification (implies speculative)",
    "gamma": "tokens drafted per speculative round",
    "specattn_p": "SpecAttn: attention mass the verify view keeps (top-p)",
}
GATEWAY_HELP = {
    "redis_url": "redis://host:port/db for session metadata (empty = in-process store)",
    "kv_budget_mb": "RAM budget for saved session KV; LRU sessions are evicted past it",
    "kv_spill_dir": "spill evicted session KV here instead of dropping it",
    "max_queue": "queued requests before 429",
}
ENGINE_HELP = {
    "target": "target GGUF (default: the fetched Qwen2.5-Coder-1.5B)",
    "speculator": "speculator GGUF (default: the fetched Qwen2.5-Coder-0.5B)",
    "n_threads": "llama.cpp threads (default: all cores)",
}


def _bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean, got {text!r}")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, helps: dict[str, str],
                        skip: Sequence[str] = ()) -> None:
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        default = field_default(f)
        kind: Any = {bool: _bool, int: int, float: float, str: str}.get(type(default))
        if kind is None:
            continue
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, type=kind, default=None,
                           metavar=type(default).__name__.upper(),
                           help=f"{helps.get(f.name, '')} (env SPECGATE_{f.name.upper()}, default {default})")


def build_parser() -> argparse.ArgumentParser:
    from gateway import prefill_cmd

    parser = argparse.ArgumentParser(prog="specgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch-models", help="download, assemble and verify the default models")
    fetch.add_argument("names", nargs="*", help="models to fetch (default: all)")
    fetch.add_argument("--models-dir", default=None, help="where to store them (env SPECGATE_MODELS_DIR)")
    fetch.set_defaults(func=run_fetch)

    pre = sub.add_parser("prefill", help="one-shot SpecPrefill of a prompt, with a per-phase table")
    prefill_cmd.add_arguments(pre)
    add_dataclass_flags(pre, EngineConfig, ENGINE_HELP)
    add_dataclass_flags(pre, PolicyConfig, POLICY_HELP, skip=("guard_keywords",))
    add_dataclass_flags(pre, SamplingParams, {}, skip=("stop",))
    pre.set_defaults(func=prefill_cmd.run)

    from gateway import calibrate_cmd

    cal = sub.add_parser("calibrate", help="measure SpecAttn's draft->target layer map for the model pair")
    calibrate_cmd.add_arguments(cal)
    add_dataclass_flags(cal, EngineConfig, ENGINE_HELP)
    cal.set_defaults(func=calibrate_cmd.run)

    from ops import bench

    bench_p = sub.add_parser("bench", help="benchmarks: first-turn TTFT, multi-turn sessions, gateway overhead")
    bench.add_arguments(bench_p)
    bench_p.set_defaults(func=bench.run)

    from ops import eval_run

    eval_p = sub.add_parser("eval", help="answer-quality harness: dense vs SpecPrefill settings on generated tasks")
    eval_run.add_arguments(eval_p)
    eval_p.set_defaults(func=eval_run.run)

    serve = sub.add_parser("serve", help="run the HTTP/WebSocket gateway")
    add_dataclass_flags(serve, GatewayConfig, GATEWAY_HELP)
    add_dataclass_flags(serve, EngineConfig, ENGINE_HELP)
    add_dataclass_flags(serve, PolicyConfig, POLICY_HELP, skip=("guard_keywords",))
    serve.set_defaults(func=run_serve)
    return parser


def run_serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from core.config import build
    from gateway.app import create_app
    from gateway.logs import configure
    from gateway.prefill_cmd import engine_config

    gateway = build(GatewayConfig, vars(args))
    configure(gateway.log_level)
    app = create_app(gateway, engine_config(args), build(PolicyConfig, vars(args)))
    web.run_app(app, host=gateway.host, port=gateway.port, print=None, access_log=None)
    return 0


def run_fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from core.model_store import fetch_all
    fetch_all(args.names or None, Path(args.models_dir) if args.models_dir else None)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args))
    except SpecGateError as exc:
        print(f"specgate: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
