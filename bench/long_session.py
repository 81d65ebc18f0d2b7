"""``specgate bench long_session``: a coding session that outgrows the window (issue 54).

A scripted coding-agent conversation on the real pair, in process (one engine, a slot per
arm, the same history in each): Claude Code's recorded system prompt and tools (~12K tokens),
then turns that each read a Python module of 2-6K tokens in Read's ``cat -n`` form
(evals.agent_files), asked in the same message about something that must be copied: a
function's exact source, the line a function is defined on, or a constant's value; about the
file just read, or, every third turn, about one read 3-10 turns earlier.  The history carries
the right answer after each turn, so every arm sees the same requests, resent whole each turn.
The session goes on until it passes 3x the window (96K with the pair's 32K; ``--n-ctx`` sets
a smaller window, for a run that costs less: each turn's attention is shallower; quick: the
window and 8K more).

Arms:
* ``default``: SpecPrefill as served, and scored eviction past the window;
* ``oldest``: the same, dropping the oldest tool results and replies first (the anchors'
  context shift: llama-server and Ollama drop the oldest half after the kept prefix);
* ``dense``: SpecPrefill off, while the prompt fits the window (past it, the 400 it got before).

Between turns each sparse arm's scorer catches up as idle time lets it (``IDLE_S``).  Per turn
and arm: TTFT, the logical and physical lengths, tokens evicted, tokens prefilled, and whether
the answer is right (evals.agent_files.correct); the summary gives answers per question kind
and age (the file just read, or older), past and before the window, and the TTFT of turns past
the window against turns at 16-24K.  Not here yet: the real Claude Code through ``specgate
launch claude`` (issue 54), and YaRN-scaled contexts as an upper bound.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

from bench.common import progress, write_result
from core.config import EngineConfig
from core.errors import PromptTooLong
from core.kv.positions import SessionKV
from core.loader import override
from core.models import model_files
from core.policies import PrefillPolicy, SamplingParams, TurnParams
from core.steps import drive
from evals.agent_files import Question, ToolResult, correct, python_module
from evals.depth import agent_prefix, max_tokens

ARMS = ("default", "oldest", "dense")
POLICIES = {"default": PrefillPolicy(), "oldest": PrefillPolicy(evict_order="oldest"),
            "dense": PrefillPolicy(enabled=False)}
IDLE_S = 10.0


def reply(q: Question) -> str:
    """What the history carries after a turn: the right answer, as an agent that got it would
    have said it (a fixed reply, "Done.", was copied by the 1.5B as the answer to every later
    question: results/long_session.md)."""
    return f"```python\n{q.answer}\n```" if q.kind == "function_source" else q.answer


def module(rng: random.Random, i: int) -> ToolResult:
    """A module of 2-6K tokens with a function to ask about (a seed that yields none is passed over)."""
    while True:
        try:
            return python_module(rng, f"src/pkg/mod_{i:02d}.py", target_chars=rng.randint(7000, 19000))
        except IndexError:
            continue


def question(rng: random.Random, i: int, files: list[ToolResult]) -> tuple[Question, int]:
    """Turn ``i``'s question and the age (in turns) of the file it is about."""
    age = rng.randint(3, min(10, i)) if i >= 3 and i % 3 == 2 else 0
    kinds = ("function_source", "constant_value", "definition_line")
    kind = kinds[(i // 3 + i) % 3]
    pool = [q for q in files[i - age].questions if q.kind == kind] or list(files[i - age].questions)
    return rng.choice(pool), age


class Session:
    """The shared history, and each arm's KV in a slot of its own."""

    def __init__(self, engine: Any, arms: tuple[str, ...]) -> None:
        self.engine, self.arms = engine, arms
        self.system, self.tools = agent_prefix()
        self.history: list[dict[str, Any]] = list(self.system)
        self.kv = {arm: SessionKV() for arm in arms}
        self.slot = {arm: i for i, arm in enumerate(arms)}

    def messages(self, i: int, result: ToolResult, q: Question) -> list[dict[str, Any]]:
        call = {"id": f"toolu_{i:04d}", "type": "function",
                "function": {"name": "Read", "arguments": f'{{"file_path": "{result.arguments["file_path"]}"}}'}}
        ask = q.ask if q.ask.startswith("Read ") else f"Read {result.arguments['file_path']}. {q.ask}"
        return [*self.history, {"role": "user", "content": ask},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": call["id"], "content": result.content}]

    def share_prefix(self, prompt: Any) -> None:
        """The system prompt and tools prefilled once, in the first arm's slot, and copied into the others."""
        n = sum(1 for s in prompt.spans if s.role == "system")
        end = prompt.spans[n - 1].end if n else 0
        first = self.arms[0]
        drive(self.engine.slot_cells.prefill_prefix(prompt.tokens[:end], self.kv[first], self.slot[first]))
        for arm in self.arms[1:]:
            self.engine.slot_cells.adopt_prefix(prompt.tokens, self.kv[arm], self.slot[arm], self.kv[first],
                                                self.slot[first])

    def turn(self, arm: str, prompt: Any, q: Question) -> dict[str, Any]:
        params = TurnParams(prefill=POLICIES[arm], sampling=SamplingParams(max_tokens=max_tokens(q, self.engine)))
        if arm == "dense" and len(prompt) + params.sampling.max_tokens > self.engine.kv_window:
            return {"refused": True}
        try:
            res = self.engine.run(prompt, params, kv=self.kv[arm], slot=self.slot[arm])
        except PromptTooLong as exc:
            return {"refused": True, "error": str(exc)}
        t = res.timings
        return {"correct": correct(q, res.text), "ttft_s": round(t.ttft_ms / 1e3, 2),
                "physical_n": t.physical_n, "evicted_n": t.evicted_n, "evict_s": round(t.evict_ms / 1e3, 2),
                "cache_n": t.cache_n, "prompt_n": t.prompt_n, "new_n": t.new_n, "specprefill": t.specprefill,
                "reply": res.text[:300]}

    def idle(self) -> None:
        for arm in self.arms:
            if arm == "dense":
                continue
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < IDLE_S:
                if not self.engine.slot_cells.catch_up_speculator(self.kv[arm], self.slot[arm], 512):
                    break


def run(engine_config: EngineConfig, out: Path, quick: bool, arms: tuple[str, ...] = ARMS,
        seed: int | None = None, n_ctx: int = 0) -> dict[str, Any]:
    from core.engine import Engine

    seed = seed if seed is not None else random.SystemRandom().randrange(1 << 30)
    config = model_files.with_default_models(override(engine_config, slots=len(arms), n_ctx=n_ctx))
    engine = Engine(config)
    goal = engine.kv_window + 8192 if quick else 3 * (engine.kv_window + 1)
    progress(f"long_session: seed {seed}, window {engine.kv_window + 1}, to {goal} logical tokens, "
             f"arms {', '.join(arms)}")
    rng, files, rows = random.Random(seed), [], []
    try:
        session = Session(engine, arms)
        for i in range(200):
            files.append(module(rng, i))
            q, age = question(rng, i, files)
            msgs = session.messages(i, files[i], q)
            prompt = engine.chat.render_chat(msgs, session.tools)
            if i == 0:
                session.share_prefix(prompt)
            row: dict[str, Any] = {"turn": i, "logical_n": len(prompt), "kind": q.kind, "age": age}
            for arm in arms:
                row[arm] = session.turn(arm, prompt, q)
            rows.append(row)
            progress(f"long_session: turn {i} at {len(prompt)} tokens: " + ", ".join(
                f"{arm} {r.get('ttft_s', '-')}s {'ok' if r.get('correct') else 'x'}" for arm, r in
                ((a, row[a]) for a in arms)))
            session.history = [*msgs, {"role": "assistant", "content": reply(q)}]
            if len(prompt) > goal:
                break
            session.idle()
        rss = _rss_mb()
    finally:
        engine.close()
    summary = summarize(rows, arms, engine.kv_window)
    summary["rss_mb"] = rss
    write_result(out, "long_session", {"seed": seed, "goal": goal, "window": engine.kv_window, "arms": arms,
                                       "summary": summary, "rows": rows},
                 {"target": config.target, "speculator": config.speculator})
    return summary


def summarize(rows: list[dict[str, Any]], arms: tuple[str, ...], window: int) -> dict[str, Any]:
    """Per arm: refusals, evictions, answers (all, and past the window), and TTFT per new token
    of the turns inside the window (the first aside: its scorer starts cold) against past it."""
    out: dict[str, Any] = {"turns": len(rows), "logical_n": rows[-1]["logical_n"] if rows else 0}
    for arm in arms:
        done = [(r, r[arm]) for r in rows if not r[arm].get("refused")]
        past = [(r, a) for r, a in done if r["logical_n"] > window]
        inside = [(r, a) for r, a in done if r["turn"] and r["logical_n"] <= window]
        out[arm] = {
            "refused": sum(1 for r in rows if r[arm].get("refused")),
            "evicted_n": sum(a["evicted_n"] for _, a in done),
            "max_physical_n": max((a["physical_n"] for _, a in done), default=0),
            "answers": _answers(done), "answers_inside_window": _answers(inside),
            "answers_past_window": _answers(past),
            "ttft_s_inside_window": _mean([a["ttft_s"] for _, a in inside]),
            "ttft_s_past_window": _mean([a["ttft_s"] for _, a in past]),
            "ttft_ms_per_new_token_inside": _per_token(inside), "ttft_ms_per_new_token_past": _per_token(past),
        }
    return out


def _per_token(turns: list[tuple[dict[str, Any], dict[str, Any]]]) -> float | None:
    return _mean([1e3 * a["ttft_s"] / a["new_n"] for _, a in turns if a["new_n"]])


def _answers(done: list[tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, str]:
    groups: dict[str, list[bool]] = {}
    for r, a in done:
        for key in (r["kind"], "just_read" if r["age"] == 0 else "older", "all"):
            groups.setdefault(key, []).append(bool(a["correct"]))
    return {k: f"{sum(v)}/{len(v)}" for k, v in sorted(groups.items())}


def _mean(xs: list[float]) -> float | None:
    return round(sum(xs) / len(xs), 3) if xs else None


def _rss_mb() -> float:
    lines = Path(f"/proc/{os.getpid()}/status").read_text().splitlines()
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), 0.0)
