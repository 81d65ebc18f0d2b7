"""``specgate eval --depth``: does SpecPrefill at depth keep what a coding agent must copy?

An agent-shaped conversation on the real pair: Claude Code's recorded system prompt and tools
(~12K tokens), then tool turns -- a Python module read with ``Read``, a pytest report, grep
output, a JSON config (evals.agent_files), generated from a fresh seed each run -- each asked
about with a question whose answer must be copied (a function's exact source, a line number,
a constant, the failing test, its message), and followed by questions about it asked later.

Two arms on one engine, with the same history: ``default`` (the server's default prefill
policy) and ``dense`` (SpecPrefill off), each in a slot of its own; every next request
carries the dense arm's reply, so the histories never part.  Between turns the scorer
catches up as idle time would let it (an agent's tool runs for seconds).

Per question: each arm's answer checked (evals.agent_files.correct), and three measures that
hold even where the 1.5B is wrong: the first greedy token's agreement with dense, the first
32 greedy tokens' agreement, and the mean negative log-likelihood of dense's greedy reply
(its tokens 2-64), teacher-forced under each arm's KV.  Plus each arm's TTFT and the share of
the tool result the default arm kept.
"""

from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import orjson

from bench.common import progress, write_result
from core.config import EngineConfig
from core.kv.positions import SessionKV
from core.models import model_files
from core.policies import PrefillPolicy, SamplingParams, TurnParams
from core.speculator import rollback
from evals.agent_files import KINDS, Question, ToolResult, correct, tool_results

if TYPE_CHECKING:
    from core.engine import Engine

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/clients/claude_code_first.json"
ARMS = ("default", "dense")
AGREE_TOKENS = 32
NLL_TOKENS = 64


def agent_prefix() -> tuple[list[dict[str, Any]], tuple[dict[str, Any], ...]]:
    """Claude Code's system messages and tools, in the chat form the gateway renders."""
    from gateway.wire.anthropic.parse import parse_messages_body

    body = orjson.loads(FIXTURE.read_bytes())["body"]
    req = parse_messages_body({**body, "stream": False}, TurnParams(), None)
    first_user = next(i for i, m in enumerate(req.messages) if m["role"] == "user")
    return list(req.messages[:first_user]), req.tools or ()


def max_tokens(q: Question, engine: Engine) -> int:
    if q.kind == "function_source":
        return len(engine.target.tokenize(q.answer, add_special=False)) + 48
    return 40


def reply_nll(engine: Engine, kv: SessionKV, slot: int, n_prompt: int, reply: list[int]) -> float:
    """Mean NLL of ``reply``'s tokens 2.. under the KV ``kv`` holds for the prompt (teacher-forced
    after its first token); the slot is left holding the prompt alone."""
    seq = engine.target_ctx.seq(slot)
    rollback(seq, kv.target, n_prompt)
    toks = reply[:NLL_TOKENS]
    if len(toks) < 2:
        return 0.0
    pos = kv.target.next_pos
    seq.decode(toks, pos, logits_last=False, logits_all=True)
    total = 0.0
    for i in range(len(toks) - 1):
        logits = engine.target_ctx.logits_at(i).astype(np.float64)
        top = logits.max()
        total += float(top + math.log(np.exp(logits - top).sum()) - logits[toks[i + 1]])
    seq.remove_from(pos)
    return total / (len(toks) - 1)


class Conversation:
    """Both arms' KV and the shared history; one question at a time."""

    def __init__(self, engine: Engine, system: list[dict[str, Any]], tools: tuple[dict[str, Any], ...]) -> None:
        self.engine, self.tools = engine, tools
        self.history: list[dict[str, Any]] = list(system)
        self.kv = {arm: SessionKV() for arm in ARMS}
        self.slot = {"default": 0, "dense": 1}
        self.params = {"default": TurnParams(prefill=PrefillPolicy()),
                       "dense": TurnParams(prefill=PrefillPolicy(enabled=False))}
        self.calls = 0

    def messages(self, q: Question, result: ToolResult | None) -> list[dict[str, Any]]:
        msgs = [*self.history, {"role": "user", "content": q.ask}]
        if result is not None:
            self.calls += 1
            call_id = f"toolu_{self.calls:04d}"
            msgs += [{"role": "assistant", "content": None, "tool_calls": [{
                "id": call_id, "type": "function",
                "function": {"name": result.tool, "arguments": orjson.dumps(result.arguments).decode()}}]},
                {"role": "tool", "tool_call_id": call_id, "content": result.content}]
        return msgs

    def ask(self, q: Question, result: ToolResult | None) -> dict[str, Any]:
        msgs = self.messages(q, result)
        prompt = self.engine.chat.render_chat(msgs, self.tools)
        sampling = SamplingParams(max_tokens=max_tokens(q, self.engine), temperature=0.0)
        out: dict[str, Any] = {"kind": q.kind, "depth": len(prompt), "follow_up": result is None}
        replies: dict[str, list[int]] = {}
        for arm in ("dense", "default"):  # dense first: the default arm's reply is compared with it
            params = TurnParams(prefill=self.params[arm].prefill, sampling=sampling)
            res = self.engine.run(prompt, params, kv=self.kv[arm], slot=self.slot[arm])
            t = res.timings
            replies[arm] = list(res.tokens)
            out[arm] = {"correct": correct(q, res.text), "ttft_s": round(t.ttft_ms / 1e3, 2),
                        "specprefill": t.specprefill, "kept_pct": round(t.kept_pct, 1), "prompt_n": t.prompt_n,
                        "cache_n": t.cache_n, "reply": res.text[:400]}
        dense, default = replies["dense"], replies["default"]
        out["first_token_agrees"] = bool(dense[:1] == default[:1])
        out["first32_agree"] = dense[:AGREE_TOKENS] == default[:AGREE_TOKENS]
        out["nll"] = {arm: round(reply_nll(self.engine, self.kv[arm], self.slot[arm], len(prompt), dense), 4)
                      for arm in ARMS}
        self.history = [*msgs, {"role": "assistant", "content": self.engine.target.detokenize(dense)}]
        return out

    def idle(self, seconds: float) -> int:
        """The gap an agent's tool leaves: the default arm's scorer catches up, as the
        server's idle work would (one chunk at a time, for ``seconds`` at most)."""
        t0, done = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds:
            step = self.engine.slot_kv.catch_up_speculator(self.kv["default"], self.slot["default"], 512)
            if not step:
                break
            done += step
        return done


def run_depth(seed: int | None, max_depth: int, idle_s: float, out: Path, quick: bool = False) -> dict[str, Any]:
    from core.engine import Engine

    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
    progress(f"eval depth: seed {seed}, up to {max_depth} tokens")
    config = model_files.with_default_models(EngineConfig(slots=2, n_ctx=max_depth + 4096))
    engine = Engine(config)
    rows: list[dict[str, Any]] = []
    try:
        system, tools = agent_prefix()
        conv = Conversation(engine, system, tools)
        for i, result in enumerate(tool_results(seed, 3 if quick else 64)):
            first = engine.chat.render_chat(conv.messages(result.questions[0], result), tools)
            if len(first) > max_depth:
                break
            for k, q in enumerate(result.questions):
                progress(f"eval depth: result {i} ({result.tool}), {q.kind} at {len(first)} tokens")
                row = conv.ask(q, result if k == 0 else None)
                row.update({"result": i, "tool": result.tool, "seed": seed})
                rows.append(row)
                conv.idle(idle_s)
    finally:
        engine.close()
    summary = summarize(rows)
    write_result(out, "eval_depth", {"seed": seed, "max_depth": max_depth, "idle_s": idle_s, "summary": summary,
                                     "rows": rows}, {"target": config.target, "speculator": config.speculator})
    return summary


def bucket(depth: int) -> str:
    return "<12K" if depth < 12288 else "12-20K" if depth < 20480 else ">=20K"


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per depth bucket and per question kind: answers right in each arm, the default arm's
    share of what dense got right, and the retention measures."""
    out: dict[str, Any] = {}
    groups: dict[str, list[dict[str, Any]]] = {"all": rows}
    for r in rows:
        groups.setdefault(f"depth {bucket(r['depth'])}", []).append(r)
        groups.setdefault(f"kind {r['kind']}", []).append(r)
    for name, group in groups.items():
        dense_right = [r for r in group if r["dense"]["correct"]]
        nll = np.array([r["nll"]["default"] - r["nll"]["dense"] for r in group])
        out[name] = {
            "n": len(group), "dense_correct": len(dense_right),
            "default_correct": sum(r["default"]["correct"] for r in group),
            "default_of_dense": round(sum(r["default"]["correct"] for r in dense_right) / len(dense_right), 3)
            if dense_right else None,
            "first_token_agree": round(float(np.mean([r["first_token_agrees"] for r in group])), 3),
            "first32_agree": round(float(np.mean([r["first32_agree"] for r in group])), 3),
            "nll_increase": {"mean": round(float(nll.mean()), 4), "p50": round(float(np.median(nll)), 4),
                             "p90": round(float(np.quantile(nll, 0.9)), 4), "max": round(float(nll.max()), 4)},
            "kept_pct_mean": round(float(np.mean([r["default"]["kept_pct"] for r in group if not r["follow_up"]]
                                                 or [100.0])), 1),
        }
    out["kinds"] = [k for k in KINDS if f"kind {k}" in out]
    return out
