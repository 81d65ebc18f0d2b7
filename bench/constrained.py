"""``specgate bench constrained``: what constrained decoding costs, and whether it holds.

Two parts, on the configured pair:

* **engines** (in process, the target's vocabulary): compiling a 20-tool call grammar
  and masking one token under it, with llguidance (what SpecGate uses) and with
  llama.cpp's own GBNF grammar sampler (the same schema through llama-cpp-python's
  ``json_schema_to_gbnf``), walking the tokens of one valid call.
* **serving** (``specgate serve`` over HTTP): decode tokens/s unconstrained against
  ``tool_choice: required`` over a coding agent's 20 tools, a named function the
  prompt does not call for, and a ``json_schema`` reply; every constrained reply is
  checked against its schema.  Decode speed falls with context, so each constraint
  is compared with the free arm of its own context: ``free`` (a short prompt) for the
  JSON reply, ``auto_20_tools`` (the same 20-tool prompt, free until the model opens
  a call) for the forced calls; ``mask_share`` is the masking time over the whole
  per-token time, the constraint's own cost.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from bench.common import free_port, progress, write_result
from bench.serving import server, specgate_cmd
from core.config import EngineConfig

_PATH = {"type": "string", "maxLength": 64}
AGENT_TOOLS = [  # the shape of a coding agent's tool block: 20 functions with small schemas
    (name, desc, props) for name, desc, props in [
        ("read_file", "Read a file.", {"path": _PATH}),
        ("write_file", "Write a file.", {"path": _PATH, "content": {"type": "string", "maxLength": 200}}),
        ("list_dir", "List a directory.", {"path": _PATH}),
        ("grep", "Search files for a pattern.", {"pattern": _PATH, "path": _PATH}),
        ("run_shell", "Run a shell command.", {"command": {"type": "string", "maxLength": 120}}),
        ("git_status", "Show git status.", {}),
        ("git_diff", "Show a diff.", {"path": _PATH}),
        ("git_commit", "Commit staged changes.", {"message": {"type": "string", "maxLength": 120}}),
        ("run_tests", "Run the tests.", {"pattern": _PATH}),
        ("apply_patch", "Apply a unified diff.", {"patch": {"type": "string", "maxLength": 200}}),
        ("find_symbol", "Find where a symbol is defined.", {"name": _PATH}),
        ("open_url", "Fetch a URL.", {"url": _PATH}),
        ("web_search", "Search the web.", {"query": _PATH}),
        ("create_dir", "Create a directory.", {"path": _PATH}),
        ("delete_file", "Delete a file.", {"path": _PATH}),
        ("move_file", "Move a file.", {"src": _PATH, "dst": _PATH}),
        ("format_code", "Format a file.", {"path": _PATH}),
        ("lint", "Lint a file.", {"path": _PATH}),
        ("set_alarm", "Set an alarm.", {"hour": {"type": "integer", "minimum": 0, "maximum": 23}}),
        ("ask_user", "Ask the user a question.", {"question": {"type": "string", "maxLength": 120}}),
    ]]
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": n, "description": d, "parameters": {
    "type": "object", "properties": p, "required": list(p), "additionalProperties": False}}} for n, d, p in AGENT_TOOLS]
REPLY_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["summary", "files", "risk"],
                "properties": {"summary": {"type": "string", "maxLength": 200},
                               "files": {"type": "array", "items": _PATH, "maxItems": 5},
                               "risk": {"enum": ["low", "medium", "high"]}}}
ARMS: dict[str, dict[str, Any]] = {
    "free": {"messages": [{"role": "user", "content": "Describe what a README file is for, in two sentences."}]},
    "auto_20_tools": {"tools": TOOLS, "tool_choice": "auto", "messages": [  # the same context, free until a call
        {"role": "user", "content": "Show me what is in the src folder, then open src/main.py."}]},
    "required_20_tools": {"tools": TOOLS, "tool_choice": "required", "messages": [
        {"role": "user", "content": "Show me what is in the src folder, then open src/main.py."}]},
    "named_function": {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "set_alarm"}},
                       "messages": [{"role": "user", "content": "Open README.md please."}]},
    "json_schema": {"messages": [{"role": "user", "content": "Summarize a change that renames main.py to app.py."}],
                    "response_format": {"type": "json_schema", "json_schema": {"name": "change",
                                                                               "schema": REPLY_SCHEMA}}},
}


def _call_schema() -> dict[str, Any]:
    return {"anyOf": [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                       "properties": {"name": {"const": t["function"]["name"]},
                                      "arguments": t["function"]["parameters"]}} for t in TOOLS]}


def engines(target: str, repeats: int) -> dict[str, Any]:
    """Compile time and per-token mask cost, llguidance against llama.cpp's GBNF sampler."""
    import llama_cpp
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    from core import constraints
    from core.decoding.guided import Guide
    from core.llama.model import Model

    model = Model(target)
    call = constraints.tool_call(TOOLS, "required", False, constraints.SYNTAXES["qwen"])
    assert call is not None
    text = '<tool_call>\n{"name": "read_file", "arguments": {"path": "src/main.py"}}\n</tool_call>'
    walk = model.tokenize(text, add_special=False, parse_special=True)
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(model.n_vocab).astype(np.float32)
    out: dict[str, Any] = {"vocab": model.n_vocab, "tokens_walked": len(walk)}

    compile_s, mask_s = [], []
    Guide(model, call)  # reads the vocabulary once (not a per-request cost)
    for _ in range(repeats):
        t0 = time.perf_counter()
        guide = Guide(model, call)
        compile_s.append(time.perf_counter() - t0)
        buf = logits.copy()
        t0 = time.perf_counter()
        for tok in walk:
            guide.matcher.unsafe_compute_mask_ptr(guide.bits.ctypes.data, guide.bits.nbytes)
            allowed = np.unpackbits(guide.bits.view(np.uint8), count=model.n_vocab, bitorder="little").view(bool)
            np.copyto(buf, -np.inf, where=~allowed)
            guide.matcher.consume_token(tok)
        mask_s.append((time.perf_counter() - t0) / len(walk))
    out["llguidance"] = {"compile_ms": round(statistics.median(compile_s) * 1e3, 3),
                         "mask_ms_per_token": round(statistics.median(mask_s) * 1e3, 4)}

    body = json_schema_to_gbnf(json.dumps(_call_schema()))
    gbnf = body.replace("root ::=", "call ::=", 1) + '\nroot ::= "<tool_call>\\n" call "\\n</tool_call>"\n'
    compile_s, mask_s = [], []
    # llama_token_data {int32 id; float logit; float p}, refilled from numpy before every token
    cand = np.zeros(model.n_vocab, dtype=[("id", "<i4"), ("logit", "<f4"), ("p", "<f4")])
    data = cand.ctypes.data_as(llama_cpp.ctypes.POINTER(llama_cpp.llama_token_data))
    for _ in range(max(1, repeats // 4)):
        t0 = time.perf_counter()
        sampler = llama_cpp.llama_sampler_init_grammar(model.vocab, gbnf.encode(), b"root")
        compile_s.append(time.perf_counter() - t0)
        if not sampler:
            out["llama_cpp_gbnf"] = {"error": "llama.cpp rejected the converted grammar"}
            return out
        t0 = time.perf_counter()
        for tok in walk:
            cand["id"], cand["logit"], cand["p"] = np.arange(model.n_vocab), logits, 0.0
            arr = llama_cpp.llama_token_data_array(data, model.n_vocab, -1, False)
            llama_cpp.llama_sampler_apply(sampler, llama_cpp.ctypes.byref(arr))
            llama_cpp.llama_sampler_accept(sampler, tok)
        mask_s.append((time.perf_counter() - t0) / len(walk))
        llama_cpp.llama_sampler_free(sampler)
    out["llama_cpp_gbnf"] = {"compile_ms": round(statistics.median(compile_s) * 1e3, 3),
                             "mask_ms_per_token": round(statistics.median(mask_s) * 1e3, 3)}
    return out


def _valid(arm: str, body: dict[str, Any]) -> bool:
    import jsonschema

    message = body["choices"][0]["message"]
    try:
        if arm == "json_schema":
            jsonschema.validate(json.loads(message["content"]), REPLY_SCHEMA)
            return True
        calls = message.get("tool_calls") or []
        offered = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
        want = {"named_function": {"set_alarm"}}.get(arm, set(offered))
        for c in calls:
            jsonschema.validate(json.loads(c["function"]["arguments"]), offered[c["function"]["name"]])
        return bool(calls) and all(c["function"]["name"] in want for c in calls)
    except (ValueError, KeyError, jsonschema.ValidationError):
        return False


def serving(engine: EngineConfig, repeats: int, log: Path) -> dict[str, Any]:
    port = free_port()
    rows: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with server(specgate_cmd(port, engine), port, log) as base, httpx.Client(base_url=base, timeout=600) as http:
        for k in range(repeats):
            for arm, body in ARMS.items():
                progress(f"constrained: {arm} {k + 1}/{repeats}")
                r = http.post("/v1/chat/completions", json={"max_tokens": 96, **body})
                doc = r.json()
                if r.status_code != 200:
                    rows[arm].append({"status": r.status_code, "error": doc})
                    continue
                t = doc["timings"]
                rows[arm].append({"status": 200, "tokens_per_s": t["predicted_per_second"],
                                  "predicted_n": t["predicted_n"], "grammar_ms": t.get("grammar_ms", 0.0),
                                  "mask_ms": t.get("mask_ms", 0.0), "finish": doc["choices"][0]["finish_reason"],
                                  "valid": None if arm in ("free", "auto_20_tools") else _valid(arm, doc)})
    def median_tps(arm: str) -> float:
        return statistics.median(r["tokens_per_s"] for r in rows[arm] if r.get("tokens_per_s"))

    baseline = {"json_schema": "free", "required_20_tools": "auto_20_tools", "named_function": "auto_20_tools"}
    summary = {}
    for arm, rs in rows.items():
        ok = [r for r in rs if r["status"] == 200 and r.get("tokens_per_s")]
        tps = statistics.median(r["tokens_per_s"] for r in ok) if ok else None
        base = baseline.get(arm, arm)
        mask = statistics.median(r["mask_ms"] / max(1, r["predicted_n"]) for r in ok) if ok else 0.0
        summary[arm] = {"requests": len(rs), "tokens_per_s_median": tps, "baseline": base,
                        "vs_free": round(tps / median_tps(base), 3) if tps else None,
                        "mask_share": round(mask * tps / 1e3, 4) if tps else None,
                        "grammar_ms_median": statistics.median(r["grammar_ms"] for r in ok) if ok else None,
                        "mask_ms_per_token_median": round(mask, 4),
                        "valid": None if arm in ("free", "auto_20_tools") else sum(bool(r.get("valid")) for r in rs)}
    return {"summary": summary, "rows": rows}


def run(engine: EngineConfig, quick: bool, out: Path) -> dict[str, Any]:
    repeats = 3 if quick else 20
    progress("constrained: engines")
    eng = engines(engine.target, 5 if quick else 20)
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    serve = serving(engine, repeats, logs / "constrained.log")
    result = {"engines": eng, **serve}
    write_result(out, "constrained", result, {"target": engine.target, "speculator": engine.speculator})
    return {"engines": eng, "serving": serve["summary"]}
