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
from core.kv.cells import rollback
from core.kv.positions import SessionKV
from core.models import model_files
from core.policies import PrefillPolicy, SamplingParams, Selection, TurnParams
from core.steps import drive
from evals.agent_files import KINDS, Question, ToolResult, correct, tool_results

if TYPE_CHECKING:
    from core.engine import Engine
    from core.prompt import Prompt

FIXTURE = Path(__file__).resolve().parents[1] / "tests/fixtures/clients/claude_code_first.json"
def _selection(recall: int = 0, **on: bool) -> PrefillPolicy:
    """A selection with exactly the line and code options named (whatever the defaults are),
    recalling up to ``recall`` tokens an earlier turn dropped (core.kv.recall)."""
    flags = {"whole_lines": False, "code_blocks": False, "code_skeleton": False, "named_lines": False, **on}
    return PrefillPolicy(selection=Selection(whole_lines=flags["whole_lines"], code_blocks=flags["code_blocks"],
                                             code_skeleton=flags["code_skeleton"], named_lines=flags["named_lines"],
                                             max_recall_tokens=recall))


POLICIES = {  # the arms a run may name: the dense reference and SpecPrefill settings
    "dense": PrefillPolicy(enabled=False),
    "default": PrefillPolicy(),
    "chunks": _selection(),  # scored chunks alone (the default)
    "lines": _selection(whole_lines=True),
    "blocks": _selection(whole_lines=True, code_blocks=True),
    "skeleton": _selection(whole_lines=True, code_blocks=True, code_skeleton=True),
    "named": _selection(whole_lines=True, named_lines=True),
    "copy": _selection(whole_lines=True, code_skeleton=True, named_lines=True),  # the default before recall
    "focus": PrefillPolicy(selection=Selection(named_focus=True)),  # the default, a named def's file narrowed
}
ARMS = ("dense", "default")
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


def prefix_end(prompt: Prompt) -> int:
    """Where the prompt's leading system messages (the agent's prompt and tools) end."""
    n = 0
    while n < len(prompt.spans) and prompt.spans[n].role == "system":
        n += 1
    return prompt.spans[n - 1].end if n else 0


def seen(engine: Engine, prompt: Prompt, kv: SessionKV) -> str:
    """What the target holds of the prompt's last tool result: its text, with each stretch
    a sparse prefill dropped written ``[... N]`` (N tokens)."""
    span = next((s for s in reversed(prompt.spans) if s.role == "tool"), None)
    if span is None:
        return ""
    held = np.asarray(kv.target.kv_pos[span.start:span.end]) >= 0
    return gapped_text(engine, prompt.tokens[span.start:span.end], held)


def gapped_text(engine: Engine, tokens: tuple[int, ...], held: np.ndarray) -> str:
    """``tokens`` as text, each stretch not ``held`` written ``[... N]``."""
    out, gap = [], 0
    for tok, kept in zip(tokens, held, strict=True):
        if kept:
            if gap:
                out.append(f"[... {gap}]")
                gap = 0
            out.append(engine.target.token_bytes(tok).decode("utf-8", "replace"))
        else:
            gap += 1
    return "".join(out) + (f"[... {gap}]" if gap else "")


class Conversation:
    """Both arms' KV and the shared history; one question at a time."""

    def __init__(self, engine: Engine, system: list[dict[str, Any]], tools: tuple[dict[str, Any], ...],
                 arms: tuple[str, ...] = ARMS) -> None:
        self.engine, self.tools, self.arms = engine, tools, arms  # arms[0] is dense: the reference
        self.history: list[dict[str, Any]] = list(system)
        self.kv = {arm: SessionKV() for arm in arms}
        self.slot = {arm: i for i, arm in enumerate(arms)}
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
        out: dict[str, Any] = {"kind": q.kind, "depth": len(prompt), "follow_up": result is None, "ask": q.ask,
                               "answer": q.answer}
        replies: dict[str, list[int]] = {}
        for arm in self.arms:  # dense first: the others are compared with it
            params = TurnParams(prefill=POLICIES[arm], sampling=sampling)
            res = self.engine.run(prompt, params, kv=self.kv[arm], slot=self.slot[arm])
            t = res.timings
            replies[arm] = list(res.tokens)
            out[arm] = {"correct": correct(q, res.text), "ttft_s": round(t.ttft_ms / 1e3, 2),
                        "specprefill": t.specprefill, "kept_pct": round(t.kept_pct, 1), "prompt_n": t.prompt_n,
                        "cache_n": t.cache_n, "recalled_n": t.recalled_n, "recall_s": round(t.recall_ms / 1e3, 2),
                        "reply": res.text[:400]}
            if arm != "dense" and (result is not None or t.recalled_n):
                out[arm]["seen"] = seen(self.engine, prompt, self.kv[arm])
        dense = replies["dense"]
        nll_dense = reply_nll(self.engine, self.kv["dense"], self.slot["dense"], len(prompt), dense)
        for arm in self.arms[1:]:
            out[arm].update({
                "first_token_agrees": replies[arm][:1] == dense[:1],
                "first32_agree": replies[arm][:AGREE_TOKENS] == dense[:AGREE_TOKENS],
                "nll_increase": round(reply_nll(self.engine, self.kv[arm], self.slot[arm], len(prompt), dense)
                                      - nll_dense, 4)})
        self.history = [*msgs, {"role": "assistant", "content": self.engine.target.detokenize(dense)}]
        return out

    def share_prefix(self, prompt: Prompt) -> int:
        """Prefill the system prompt and tools once, densely in both models, in the dense arm's
        slot, and copy it into every other arm's (a sibling conversation's start): the arms
        then differ only in what follows.  Returns the prefix's tokens."""
        end = prefix_end(prompt)
        ref, slot = self.kv["dense"], self.slot["dense"]
        drive(self.engine.slot_cells.prefill_prefix(prompt.tokens[:end], ref, slot))
        for arm in self.arms[1:]:
            self.engine.slot_cells.adopt_prefix(prompt.tokens, self.kv[arm], self.slot[arm], ref, slot)
        return end

    def idle(self, seconds: float) -> int:
        """The gap an agent's tool leaves: the sparse arms' scorers catch up, as the server's
        idle work would (a chunk at a time, for ``seconds`` at most for each)."""
        done = 0
        for arm in self.arms[1:]:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                step = self.engine.slot_cells.catch_up_speculator(self.kv[arm], self.slot[arm], 512)
                if not step:
                    break
                done += step
        return done


def run_depth(seed: int | None, max_depth: int, idle_s: float, out: Path, quick: bool = False,
              arms: tuple[str, ...] = ARMS) -> dict[str, Any]:
    from core.engine import Engine

    if arms[0] != "dense" or set(arms) - set(POLICIES):
        raise ValueError(f"arms: dense first, then some of {sorted(set(POLICIES) - {'dense'})}; got {arms}")
    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
    progress(f"eval depth: seed {seed}, up to {max_depth} tokens, arms {', '.join(arms)}")
    config = model_files.with_default_models(EngineConfig(slots=len(arms), n_ctx=max_depth + 4096))
    engine = Engine(config)
    rows: list[dict[str, Any]] = []
    try:
        system, tools = agent_prefix()
        conv = Conversation(engine, system, tools, arms)
        for i, result in enumerate(tool_results(seed, 3 if quick else 64)):
            first = engine.chat.render_chat(conv.messages(result.questions[0], result), tools)
            if i == 0:
                progress(f"eval depth: the agent's prefix, {conv.share_prefix(first)} tokens, in every arm")
                conv.calls = 0
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
    summary = summarize(rows, arms)
    write_result(out, "eval_depth", {"seed": seed, "max_depth": max_depth, "idle_s": idle_s, "arms": arms,
                                     "summary": summary,
                                     "rows": rows}, {"target": config.target, "speculator": config.speculator})
    return summary


def bucket(depth: int) -> str:
    return "<12K" if depth < 12288 else "12-20K" if depth < 20480 else ">=20K"


def summarize(rows: list[dict[str, Any]], arms: tuple[str, ...] = ARMS) -> dict[str, Any]:
    """Per depth bucket and per question kind, for each sparse arm: answers right, its share of
    what dense got right, and the retention measures against dense."""
    groups: dict[str, list[dict[str, Any]]] = {"all": rows}
    for r in rows:
        groups.setdefault(f"depth {bucket(r['depth'])}", []).append(r)
        groups.setdefault(f"kind {r['kind']}", []).append(r)
    out: dict[str, Any] = {"kinds": [k for k in KINDS if f"kind {k}" in groups]}
    for name, group in groups.items():
        dense_right = [r for r in group if r["dense"]["correct"]]
        one: dict[str, Any] = {"n": len(group), "dense_correct": len(dense_right)}
        for arm in arms[1:]:
            nll = np.array([r[arm]["nll_increase"] for r in group])
            reads = [r[arm]["kept_pct"] for r in group if not r["follow_up"]]
            one[arm] = {
                "correct": sum(r[arm]["correct"] for r in group),
                "of_dense": round(sum(r[arm]["correct"] for r in dense_right) / len(dense_right), 3)
                if dense_right else None,
                "first_token_agree": round(float(np.mean([r[arm]["first_token_agrees"] for r in group])), 3),
                "first32_agree": round(float(np.mean([r[arm]["first32_agree"] for r in group])), 3),
                "nll_increase": {"mean": round(float(nll.mean()), 4), "p50": round(float(np.median(nll)), 4),
                                 "p90": round(float(np.quantile(nll, 0.9)), 4), "max": round(float(nll.max()), 4)},
                "kept_pct_mean": round(float(np.mean(reads)), 1) if reads else None,
                "ttft_vs_dense": round(float(np.mean([r[arm]["ttft_s"] / r["dense"]["ttft_s"] for r in group
                                                      if not r["follow_up"]] or [1.0])), 3),
            }
        out[name] = one
    return out
