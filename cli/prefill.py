"""``specgate prefill``: the one-shot tool, like the seed's ``llama-specprefill``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import orjson

from core.chat import ChatTemplate
from core.config import EngineConfig
from core.engine import Engine
from core.errors import InvalidRequest
from core.loader import build, override
from core.models.model_files import with_default_models
from core.policies import DecodingPolicy, PrefillPolicy, SamplingParams, TurnParams
from core.prompt import Prompt
from core.results import Result


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
    return with_default_models(build(EngineConfig, vars(args)))


def run(args: argparse.Namespace) -> int:
    params = TurnParams(build(PrefillPolicy, vars(args)), build(DecodingPolicy, vars(args)),
                        build(SamplingParams, vars(args)))
    text = read_prompt_text(args)
    engine = Engine(engine_config(args))
    try:
        prompt = to_prompt(engine, text, args.no_template)
        result = engine.run(prompt, params)
        dense = engine.run(prompt, override(params, enabled=False)) if args.compare else None
    finally:
        engine.close()
    if args.json:
        sys.stdout.write(orjson.dumps(report(result, dense), option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print_table(result, dense)
    return 0


def report(result: Result, dense: Result | None) -> dict[str, Any]:
    t = result.timings
    out: dict[str, Any] = {"answer": result.text, "finish_reason": result.finish_reason,
                           "kept_pct": round(t.kept_pct, 2), **t.to_json()}
    if dense is not None:
        out.update(dense_answer=dense.text, dense_prompt_ms=round(dense.timings.prompt_ms, 1),
                   dense_ttft_ms=round(dense.timings.ttft_ms, 1),
                   speedup=round(dense.timings.ttft_ms / t.ttft_ms, 3) if t.ttft_ms else None)
    return out


LABELS = {"specprefill": "status", "position_mode": "position mode", "context_n": "prompt tokens",
          "prompt_n": "kept tokens", "speculator_prefill_ms": "speculator prefill", "lookahead_ms": "lookahead",
          "scoring_ms": "scoring total", "prompt_ms": "target prefill", "predicted_ms": "decode", "ttft_ms": "TTFT",
          "draft_acceptance": "draft acceptance", "kv_selected_fraction": "KV cells attended"}


def print_table(result: Result, dense: Result | None) -> None:
    t, js = result.timings, result.timings.to_json()
    print(result.text.strip())
    print()
    shown = {
        "specprefill": f"{t.specprefill} ({t.specprefill_reason})",
        "prompt_n": f"{t.prompt_n} ({t.kept_pct:.1f}%) in {t.kept_runs} runs",
        "predicted_ms": f"{t.predicted_ms:10.1f} ms ({t.predicted_n} tokens, {t.decode_mode})",
    }
    rows = [(label, shown.get(key) or (f"{js[key]:10.1f} ms" if key.endswith("_ms") else str(js[key])))
            for key, label in LABELS.items() if key in js]
    if dense is not None:
        rows += [("dense prefill", f"{dense.timings.prompt_ms:10.1f} ms"),
                 ("dense TTFT", f"{dense.timings.ttft_ms:10.1f} ms"),
                 ("speedup", f"{dense.timings.ttft_ms / t.ttft_ms:10.2f}x" if t.ttft_ms else "n/a"),
                 ("dense answer", dense.text.strip()[:200])]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
