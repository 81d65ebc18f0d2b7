"""The ``specgate`` console script: one parser, one subcommand per tool.

Every option defaults to None so that core.loader.build applies the one
documented precedence: flag > SPECGATE_* environment variable > default.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from core.config import EngineConfig
from core.errors import SpecGateError
from core.loader import field_default, flat_fields
from core.policies import DecodingPolicy, PrefillPolicy, SamplingParams
from gateway.serve_config import GatewayConfig

HELP = {
    "enabled": "run SpecPrefill at all",
    "lookahead": "greedy speculator steps scored after the last prompt token",
    "pool_kernel": "mean-pool width along tokens (0/1 = off)",
    "select_mode": "mass | chunk",
    "mass": "mass mode: keep chunks until this share of the score",
    "keep_fraction": "chunk mode: fraction of chunks kept",
    "max_keep": "cap on kept tokens (0 = none), lowest chunks dropped first",
    "whole_lines": "a kept token keeps its whole line (line-oriented tool results: files, logs, grep output)",
    "code_blocks": "a kept def or class line keeps the block indented under it (a function's source is copied "
                   "whole by agents)",
    "code_skeleton": "in source code, keep every top-level import, decorator and assignment and every def and "
                     "class line, whatever their scores",
    "named_lines": "keep every line that holds a name the request names (its last user message and the tool "
                   "calls after it: snake_case, CONSTANTS, camelCase, `quoted`), and the block a named def opens",
    "named_focus": "in source code where the request names a def or class the file opens, keep of the file only "
                   "the named lines and blocks (later questions name what they need, and recall brings it back)",
    "max_line_tokens": "the line options widen or add only lines of at most this many tokens (one-line JSON and "
                       "unwrapped prose stay as scored; 0 = no bound)",
    "max_recall_tokens": "with named_lines, an earlier turn's tokens a sparse prefill dropped, on lines this "
                         "request names (or in a named def's block), are prefilled back first, up to this many "
                         "(0 = off)",
    "scorer_ahead_tokens": "a turn that prefills this many tokens densely while its scorer lags as many prefills "
                           "the scorer too, through the scoring window, so the tool turns after it score only their "
                           "own tokens (0 = off: idle time catches the scorer up)",
    "position_mode": "original (bridge) | compact",
    "min_tokens": "prompts shorter than this skip scoring",
    "break_even": "skip when scoring would cost more than it saves",
    "safety": "break-even safety factor",
    "bridge": "original mode: also prefill gaps between kept runs that cost less than one more run",
    "scorer": "model that scores prompts: speculator-full | speculator-q4_0 (its Q4_0 copy) | speculator-early:R | "
              "target-early:R (first R blocks)",
    "scoring_window": "the scoring model prefills long prompts attending to the first 64 and the last this many "
                      "cells; the scored rows see all (0 = off)",
    "max_context_tokens": "the longest prompt a turn may send, in tokens (0 = 4x the window); past the window a "
                          "session keeps its least important cells out (scored eviction), past this it gets a 400",
    "evict_order": "past the window, what a session drops first: scored (its chunks the speculator scored "
                   "lowest) | oldest (its oldest tool results and replies, as llama-server's context shift)",
    "recent_tokens": "past the window, a conversation's last this many tokens stay whole where they can",
    "score_agg": "max (over heads and layers) | filter-sum | filter-max (the scorer's last layer, GemFilter)",
    "guard_mode": "structural (keep structure dense, sparsify tool results) | skip (no SpecPrefill with tools)",
    "speculative": "speculative decoding: the speculator drafts, the target verifies",
    "specattn": "speculative decoding with SpecAttn sparse verification (implies speculative)",
    "lookup": "prompt-lookup decoding: drafts copied from the conversation (the longest suffix found earlier), "
              "verified by the target in one batch",
    "gamma": "tokens drafted per speculative round",
    "specattn_p": "SpecAttn: attention mass the verify view keeps (top-p)",
    "decode_auto": "a turn that asks for no decoding mode takes the one measured fastest at its depth "
                   "(plain until another mode has been measured faster here)",
    "redis_url": "redis://host:port/db for session metadata (empty = in-process store)",
    "kv_budget_mb": "RAM budget for saved session KV; LRU sessions are evicted past it",
    "prefix_min_tokens": "cache the KV of system prompts this long for new sessions of the same key (0 = off)",
    "splice_min_tokens": "past the prefix a new conversation shares with an idle one of the same key, reuse a run "
                         "of at least this many tokens that both hold at different positions (its K rotated into "
                         "place; 0 = off)",
    "implicit_sessions": "requests that name no session continue the held conversation their tokens match",
    "implicit_min_share": "share of a prompt such a match must cover to be reused",
    "kv_spill_dir": "spill evicted session KV here instead of dropping it",
    "max_queue": "queued requests before 429",
    "step_tokens": "most prefill tokens a step carries while other turns stream (0 = decode first)",
    "prefill_share": "such a chunk costs at most this share of the rest of its step (0 = a fixed chunk)",
    "auto_create_sessions": "create a session on the first chat request that names an unknown X-SpecGate-Session",
    "target": "target GGUF (default: the fetched Qwen2.5-Coder-1.5B)",
    "speculator": "speculator GGUF (default: the fetched Qwen2.5-Coder-0.5B)",
    "n_threads": "llama.cpp threads (default: all cores)",
    "api_keys_file": "file of API keys, one per line (or SPECGATE_API_KEYS=k1,k2); none = no authentication",
    "kv_spill_max_mb": "disk the spilled KV may take; past it the oldest spills are dropped",
    "kv_tier_dir": "keep shared prefixes' and sessions' KV in this folder across restarts, and share it with "
                   "replicas that use the same one; or a redis:// URL (chunked, with a TTL and the byte budget "
                   "below); auto: the cache dir, next to the models; empty: off",
    "kv_tier_max_mb": "disk the KV tier may take; past it the least recently used entries are dropped",
    "kv_checkpoint_tokens": "in idle time, save a session's KV to the KV tier once it holds this many tokens more "
                            "than its last save, so a replica taking it over, or a restart, restores it (0: off)",
    "kv_tier_secret": "keys the KV tier's checksums, so an entry written without it is refused (every replica "
                      "sharing a tier needs the same; SPECGATE_KV_TIER_SECRET); empty: one generated once into "
                      "the cache dir (kv-tier.secret, 0600)",
    "kv_tier_timeout_s": "the model thread waits this long for one KV tier lookup (an entry's read: a second more per "
                         "16 MB of it); past it the turn builds what it "
                         "looked for, and lookups miss at once for 30 s",
    "kv_tier_queue_mb": "KV tier writes that may wait at once; past it a checkpoint is skipped and counted",
    "isolate_conversations": "many end users behind one API key: a new conversation reuses only the shared system "
                             "prompt and tools of the key's other conversations, never their turns (no splices, "
                             "no lending from their checkpoints)",
    "catch_up_tokens": "with no turn running, catch idle sessions' scorer KV up in chunks of this many tokens, so "
                       "their next turn scores only its new tokens, and rewrite a held reply that called tools in the "
                       "form the client resends it (0: off; an arriving turn waits one chunk at most)",
    "drain_timeout_s": "on SIGTERM, how long running turns may take to finish",
    "max_messages": "most messages one request may carry (413 past it)",
    "max_prompt_chars": "most content characters one request may carry (0 = 16 per context token)",
    "max_tool_depth": "deepest JSON nesting of tool definitions",
    "max_tokens_cap": "a request's max_tokens is clamped to this (and to what the context leaves), never refused",
    "default_max_tokens": "max_tokens of a request that sets none",
    "progress_log_s": "a long prefill logs its progress (tokens done, rate, time left) this often",
    "allow_foreign_origins": "with no API keys on loopback, also take requests whose Origin or Host names another "
                             "machine (web pages; refused by default)",
    "keepalive_s": "a quiet stream (a long prefill) sends a keepalive this often: Anthropic ping, SSE comment",
    "stream_hold_s": "a stream's headers wait this long for its first token, so a balancer can replay the request "
                     "if the replica dies in its prefill (0: at once; keep it under your proxy's idle timeout)",
    "keep_billing_header": "keep Claude Code's per-conversation billing line at the head of the system prompt "
                           "(stripped by default so conversations share their prompt's KV)",
    "max_sessions": "live sessions this process holds (429 past it)",
    "max_sessions_per_key": "sessions one API key may hold (429 past it)",
    "max_stored_response_bytes": "stored Responses bodies one conversation keeps, in bytes (older ones are dropped "
                                 "first; they can still be continued)",
}


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()) -> None:
    """One ``--flag`` per (flat) field of ``cls``.  Values stay strings here: core.config
    converts and validates them, so flags and SPECGATE_* variables share one parser."""
    group = parser.add_argument_group(cls.__name__)
    for f in flat_fields(cls):
        default = field_default(f)
        if f.name in skip or type(default) not in (bool, int, float, str):
            continue
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=None,
                           metavar=type(default).__name__.upper(),
                           help=f"{HELP.get(f.name, '')} (env SPECGATE_{f.name.upper()}, default {default})")


def build_parser() -> argparse.ArgumentParser:
    # benches and evals import only their argument definitions here; their heavy
    # dependencies load when they run
    from bench import cli as bench_cli
    from cli import calibrate, launch, prefill, serve
    from evals import cli as eval_cli

    parser = argparse.ArgumentParser(prog="specgate", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    fetch = sub.add_parser("fetch-models", help="download, assemble and verify the default models")
    fetch.add_argument("names", nargs="*", help="models to fetch (default: all)")
    fetch.add_argument("--models-dir", default=None, help="where to store them (env SPECGATE_MODELS_DIR)")
    fetch.set_defaults(func=run_fetch)

    pre = sub.add_parser("prefill", help="one-shot SpecPrefill of a prompt, with a per-phase table")
    prefill.add_arguments(pre)
    for one_shot in (EngineConfig, PrefillPolicy, DecodingPolicy, SamplingParams):
        add_dataclass_flags(pre, one_shot)
    pre.set_defaults(func=prefill.run)

    cal = sub.add_parser("calibrate", help="measure SpecAttn's draft->target layer map for the model pair")
    calibrate.add_arguments(cal)
    add_dataclass_flags(cal, EngineConfig)
    cal.set_defaults(func=calibrate.run)

    bench_p = sub.add_parser("bench", help="benchmarks: first-turn TTFT, multi-turn sessions, gateway overhead")
    bench_cli.add_arguments(bench_p)
    bench_p.set_defaults(func=bench_cli.run)

    eval_p = sub.add_parser("eval", help="answer-quality harness: dense vs SpecPrefill settings on generated tasks")
    eval_cli.add_arguments(eval_p)
    eval_p.set_defaults(func=eval_cli.run)

    run_agent = sub.add_parser("launch", help="run Claude Code, Codex or opencode against a running server, "
                               "set up from its /v1/models (private config; yours untouched)")
    launch.add_arguments(run_agent)
    run_agent.set_defaults(func=launch.run)

    srv = sub.add_parser("serve", help="run the HTTP/WebSocket gateway")
    for served in (GatewayConfig, EngineConfig, PrefillPolicy, DecodingPolicy):
        add_dataclass_flags(srv, served)
    srv.set_defaults(func=serve.run)
    return parser


def run_fetch(args: argparse.Namespace) -> int:
    from pathlib import Path

    from core.models.model_files import fetch_all
    fetch_all(args.names or None, Path(args.models_dir) if args.models_dir else None)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    from cli.logs import configure

    configure("warning")  # log lines to stderr: a command's own output (JSON, tables) owns stdout; serve sets its level
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
