"""``specgate prefill``: the one-shot tool, like the seed's ``llama-specprefill``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from core import model_store
from core.chat import ChatTemplate
from core.config import EngineConfig, PolicyConfig, SamplingParams, build, override
from core.engine import Engine, Result
from core.errors import InvalidRequest
from core.prompt import Prompt
from gateway.protocol import decoding_timings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", nargs="?", help="prompt text (default: --prompt-file or stdin)")
    parser.add_argument("--prompt-file", "-f", help="read the prompt from this file")
    parser.add_argument("--no-template", action="store_true",
                        help="tokenize raw text as is instead of wrapping it as one user message")
    parser.add_argument("--compare", action="store_true", help="also run dense prefill and report the speedup")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def read_prompt_text(args: argparse.Namespace) -> str:
    if args.prompt is not None:
        return str(args.prompt)
    if args.prompt_file:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    if sys.stdin.isatty():
        raise InvalidRequest("no prompt: pass text, --prompt-file, or pipe it on stdin")
    return sys.stdin.read()


def to_prompt(engine: Engine, text: str, no_template: bool) -> Prompt:
    """Chat JSON (a message list or {"messages": [...], "tools": [...]}) or raw text."""
    stripped = text.lstrip()
    if stripped[:1] in ("[", "{"):
        try:
            doc: Any = orjson.loads(text)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, list) or (isinstance(doc, dict) and "messages" in doc):
            messages = doc if isinstance(doc, list) else doc["messages"]
            tools = None if isinstance(doc, list) else doc.get("tools")
            return ChatTemplate(engine.target).render(messages, tools)
    if no_template:
        return Prompt(tuple(engine.target.tokenize(text)))
    return ChatTemplate(engine.target).render([{"role": "user", "content": text}])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    cfg = build(EngineConfig, vars(args))
    return override(cfg,
                    target=cfg.target or str(model_store.model_path(model_store.TARGET)),
                    speculator=cfg.speculator or str(model_store.model_path(model_store.SPECULATOR)))


def run(args: argparse.Namespace) -> int:
    policy = build(PolicyConfig, vars(args))
    sampling = build(SamplingParams, vars(args))
    text = read_prompt_text(args)
    engine = Engine(engine_config(args))
    try:
        prompt = to_prompt(engine, text, args.no_template)
        result = engine.run(prompt, policy, sampling)
        dense = engine.run(prompt, override(policy, enabled=False), sampling) if args.compare else None
    finally:
        engine.close()
    if args.json:
        sys.stdout.write(orjson.dumps(report(result, dense), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print_table(result, dense)
    return 0


def report(result: Result, dense: Result | None) -> dict[str, Any]:
    t = result.timings
    out: dict[str, Any] = {
        "answer": result.text, "finish_reason": result.finish_reason, "status": t.status,
        "reason": t.reason, "n_prompt": t.n_prompt, "n_kept": t.n_kept,
        "kept_pct": round(t.kept_pct, 2), "n_runs": t.n_runs, "position_mode": t.position_mode,
        "spec_prefill_ms": round(t.spec_prefill_ms, 1), "lookahead_ms": round(t.lookahead_ms, 1),
        "scoring_ms": round(t.scoring_ms, 1), "prefill_ms": round(t.prefill_ms, 1),
        "decode_ms": round(t.decode_ms, 1), "ttft_ms": round(t.ttft_ms, 1), "n_predicted": t.n_predicted,
        **decoding_timings(t),
    }
    if dense is not None:
        out.update(dense_answer=dense.text, dense_prefill_ms=round(dense.timings.prefill_ms, 1),
                   dense_ttft_ms=round(dense.timings.ttft_ms, 1),
                   speedup=round(dense.timings.ttft_ms / t.ttft_ms, 3) if t.ttft_ms else None)
    return out


def print_table(result: Result, dense: Result | None) -> None:
    t = result.timings
    print(result.text.strip())
    print()
    rows = [
        ("status", f"{t.status} ({t.reason})"),
        ("position mode", t.position_mode),
        ("prompt tokens", f"{t.n_prompt}"),
        ("kept tokens", f"{t.n_kept} ({t.kept_pct:.1f}%) in {t.n_runs} runs"),
        ("speculator prefill", f"{t.spec_prefill_ms:10.1f} ms"),
        ("lookahead", f"{t.lookahead_ms:10.1f} ms"),
        ("scoring total", f"{t.scoring_ms:10.1f} ms"),
        ("target prefill", f"{t.prefill_ms:10.1f} ms"),
        ("decode", f"{t.decode_ms:10.1f} ms ({t.n_predicted} tokens, {t.decode_mode})"),
        ("TTFT", f"{t.ttft_ms:10.1f} ms"),
    ]
    if t.decode_mode != "plain":
        rows.append(("draft acceptance", f"{t.spec.accept_rate:.2f} ({t.spec.n_accepted}/{t.spec.n_drafted}), "
                                         f"KV cells attended {100 * t.spec.selected_frac:.1f}%"))
    if dense is not None:
        rows += [("dense prefill", f"{dense.timings.prefill_ms:10.1f} ms"),
                 ("dense TTFT", f"{dense.timings.ttft_ms:10.1f} ms"),
                 ("speedup", f"{dense.timings.ttft_ms / t.ttft_ms:10.2f}x" if t.ttft_ms else "n/a"),
                 ("dense answer", dense.text.strip()[:200])]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
