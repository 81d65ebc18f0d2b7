"""``specgate bench decode_copy``: replies that copy their context, decoded plain, with
prompt-lookup drafts, and with the draft model (issue 55).

On the real pair, one engine, a conversation grown to each depth (4K and 20K by default) from
Python modules read with ``Read`` (evals.agent_files: generated, never seen), then four
replies at that depth, each decoded in every arm from the same prefilled context:

- ``edit``: an ``Edit`` call forced by ``tool_choice`` (under its grammar) whose ``old_string``
  is a function from the file read last;
- ``rewrite``: a function of the file read last, written out again with a docstring added
  (a ``Write`` of a file that is mostly the old one, in a size the 1.5B still copies);
- ``explain``: what the module does, in prose (free);
- ``plan``: a numbered plan (free).

Per reply and arm: tokens decoded, decode tokens/s, drafts proposed and accepted, and whether
the tokens are plain greedy decoding's.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import orjson

from bench.common import progress, write_result
from core.config import EngineConfig
from core.constraints import SYNTAXES, tool_call
from core.kv.positions import SessionKV
from core.models import model_files
from core.policies import DecodingPolicy, PrefillPolicy, SamplingParams, TurnParams
from evals.agent_files import python_module

ARMS = {"plain": {}, "lookup": {"lookup": True}, "speculative": {"speculative": True}}
EDIT_TOOL = {"type": "function", "function": {"name": "Edit", "description": "Replace old_string with new_string "
             "in a file; old_string must match the file exactly.", "parameters": {
                 "type": "object", "properties": {"file_path": {"type": "string"}, "old_string": {"type": "string"},
                                                  "new_string": {"type": "string"}},
                 "required": ["file_path", "old_string", "new_string"]}}}
MAX_TOKENS = 256


def context(engine: Any, depth: int, seed: int) -> tuple[list[dict[str, Any]], Any]:
    """A conversation of file reads grown to about ``depth`` tokens; returns it and the last file."""
    rng = random.Random(seed)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a coding agent. You edit files with "
                                       "the Edit tool; its old_string must match the file exactly."}]
    k, last = 0, None
    while len(engine.chat.render_chat(messages, (EDIT_TOOL,))) < depth - 3000:
        k += 1
        last = python_module(rng, f"src/pkg/mod_{k}.py")
        messages += [{"role": "user", "content": f"Read src/pkg/mod_{k}.py."},
                     {"role": "assistant", "content": None, "tool_calls": [{
                         "id": f"call_{k}", "type": "function",
                         "function": {"name": "Read", "arguments": orjson.dumps(last.arguments).decode()}}]},
                     {"role": "tool", "tool_call_id": f"call_{k}", "content": last.content},
                     {"role": "assistant", "content": f"I have read src/pkg/mod_{k}.py."}]
    return messages, last


def asks(last: Any) -> dict[str, tuple[str, bool]]:
    """Each reply's user message, and whether it is a forced Edit call."""
    fn = last.questions[0].answer.split("(")[0].removeprefix("def ")
    path = last.arguments["file_path"]
    return {
        "edit": (f"In {path}, rename the function `{fn}` to `{fn}_v2`. Call Edit with old_string set to the "
                 f"function's whole current source, copied exactly, and new_string the renamed source.", True),
        "rewrite": (f"Rewrite the function `{fn}` from {path} with a one-line docstring added under its def line. "
                    "Reply with the whole function in one python code block, without line numbers.", False),
        "explain": ("Explain in one paragraph, in your own words, what kind of code these modules hold and how "
                    "they could be tested.", False),
        "plan": ("Write a numbered plan of five steps to add logging to these modules. Be brief.", False),
    }


def run(engine_config: EngineConfig, out: Path, depths: tuple[int, ...] = (4096, 20480), seed: int = 7,
        arms: tuple[str, ...] = tuple(ARMS)) -> dict:
    from core.engine import Engine

    config = model_files.with_default_models(EngineConfig(
        target=engine_config.target, speculator=engine_config.speculator, scorer="speculator-full", slots=1,
        n_ctx=max(depths) + 4096))  # the full speculator drafts; the Q4_0 copy only scores
    engine = Engine(config)
    rows: list[dict[str, Any]] = []
    try:
        for depth in depths:
            messages, last = context(engine, depth, seed)
            kv = SessionKV()
            engine.slot_cells.load(None)
            for kind, (ask, forced) in asks(last).items():
                constraint = tool_call([EDIT_TOOL], "Edit", False, SYNTAXES["qwen"]) if forced else None
                prompt = engine.chat.render_chat([*messages, {"role": "user", "content": ask}], (EDIT_TOOL,),
                                                 has_grammar=forced)
                plain_tokens: list[int] = []
                for arm in dict.fromkeys(("plain", *arms)):  # plain first: the reference
                    decoding = ARMS[arm]
                    progress(f"decode_copy: {len(prompt)} tokens, {kind}, {arm}")
                    params = TurnParams(prefill=PrefillPolicy(enabled=False), decoding=DecodingPolicy(**decoding),
                                        sampling=SamplingParams(max_tokens=MAX_TOKENS, constraint=constraint))
                    t0 = time.perf_counter()
                    res = engine.run(prompt, params, kv=kv)
                    t = res.timings
                    stats = t.speculative
                    if arm == "plain":
                        plain_tokens = list(res.tokens)
                    rows.append({"depth": len(prompt), "kind": kind, "arm": arm, "tokens": len(res.tokens),
                                 "decode_tok_s": round(len(res.tokens) / max(t.predicted_ms / 1e3, 1e-9), 2),
                                 "wall_s": round(time.perf_counter() - t0, 1), "drafted": stats.n_drafted,
                                 "accepted": stats.n_accepted, "rounds": stats.n_rounds,
                                 "same_as_plain": list(res.tokens) == plain_tokens, "reply": res.text[:300]})
    finally:
        engine.close()
    summary = summarize(rows)
    write_result(out, "decode_copy", {"summary": summary, "rows": rows, "seed": seed},
                 {"target": config.target, "speculator": config.speculator})
    return summary


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per depth and reply: each arm's tokens/s against plain's, acceptance, and identity."""
    out: dict[str, Any] = {}
    for r in rows:
        plain = next(p for p in rows if p["depth"] == r["depth"] and p["kind"] == r["kind"] and p["arm"] == "plain")
        key = f"{r['depth']} {r['kind']}"
        out.setdefault(key, {})[r["arm"]] = {
            "tok_s": r["decode_tok_s"], "vs_plain": round(r["decode_tok_s"] / max(plain["decode_tok_s"], 1e-9), 2),
            "acceptance": round(r["accepted"] / r["drafted"], 3) if r["drafted"] else None,
            "same_as_plain": r["same_as_plain"], "tokens": r["tokens"]}
    return out
