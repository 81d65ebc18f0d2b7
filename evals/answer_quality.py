"""``specgate eval``: answer accuracy of dense prefill against SpecPrefill settings.

Per task the target runs dense once; the speculator captures attention once
(lookahead 8), and lookahead 1/4/8 and pooling on/off are derived from those
captured steps; each setting then costs one sparse target pass.  Layer-truncated
scorers (the first K blocks of the speculator) run as extra arms with their
scoring time and the overlap of their kept set with the full scorer's.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.common import progress, write_result
from core.config import EngineConfig
from core.kv.positions import SessionKV
from core.models import model_files
from core.models.scorer_cuts import derived, requantized
from core.policies import PrefillPolicy, SamplingParams, Selection, TurnParams
from core.prompt import Prompt
from core.results import Timings
from core.specprefill.scoring import importance
from core.specprefill.selection import select_tokens
from core.steps import drive
from evals import tasks as eval_tasks
from evals.scorer_adoption import adoption

if TYPE_CHECKING:  # the engine (llama.cpp) loads only when an evaluation runs
    from core.engine import Engine

ANSWER = SamplingParams(max_tokens=16)  # after the task's answer prefix (evals.tasks)


@dataclass(slots=True, frozen=True)
class Setting:
    name: str
    mode: str = "original"
    selection: Selection = Selection()
    lookahead: int = 8
    pool: int = 13
    scorer: str = "full"
    agg: str = "max"


def scorer_model(name: str) -> Path:
    """``S{k}``: the speculator's first k blocks; ``T{k}``: the target's (GemFilter proper);
    ``q4_0``: the whole speculator re-quantized to Q4_0 (``--scorer speculator-q4_0``);
    ``q4_0w<W>``: that one, prefilling through a scoring window of W cells."""
    if name.startswith("q4_0"):
        return requantized(model_files.model_path(model_files.SPECULATOR), "Q4_0", model_files.SPECULATOR.sha256)
    spec = {"S": model_files.SPECULATOR, "T": model_files.TARGET}[name[0]]
    return derived(int(name[1:]), spec)


def window(name: str) -> int:
    """The scoring window a scorer name asks for (``q4_0w1024``: 1024), else 0."""
    return int(name[5:]) if name.startswith("q4_0w") else 0


def scorer_settings(scorers: tuple[str, ...]) -> list[Setting]:
    """Per cheaper scorer: the guide's aggregation (lookahead 1) against the filter layer's
    (lookahead 0, GemFilter's last row alone, and 1), in original positions; the filter
    layer in compact positions for the half-depth scorers.  Today's scorer in both modes."""
    out = [Setting("full-max-la1-original", lookahead=1),  # today's default scorer
           Setting("full-max-la1-compact", "compact", lookahead=1),
           Setting("full-filter-sum-la1-original", lookahead=1, agg="filter-sum")]
    for name in scorers:
        if name.startswith("q4_0w"):  # the default scorer through a window: the default settings
            out.append(Setting(f"{name}-max-la1-original", scorer=name, lookahead=1))
            continue
        if name == "q4_0":  # the whole model: the default aggregation, in both position modes
            out += [Setting(f"q4_0-max-la1-{mode}", mode, scorer=name, lookahead=1) for mode in ("original", "compact")]
            continue
        out.append(Setting(f"{name}-max-la1-original", scorer=name, agg="max", lookahead=1))
        for la in (0, 1):
            out.append(Setting(f"{name}-filter-sum-la{la}-original", scorer=name, agg="filter-sum", lookahead=la))
        if name in ("S12", "T14"):
            out.append(Setting(f"{name}-filter-sum-la1-compact", "compact", scorer=name, agg="filter-sum",
                               lookahead=1))
    return out


def capture_settings(captures: tuple[str, ...]) -> list[Setting]:
    """The default scorer (lookahead 1, original and compact positions) once per attention
    capture: the first capture is the engine's own (scorer ``full``), each other one an extra
    scoring engine named ``capture-<kind>``."""
    out = []
    for i, kind in enumerate(captures):
        scorer = "full" if i == 0 else f"capture-{kind}"
        out += [Setting(f"{kind}-la1-{mode}", mode, lookahead=1, scorer=scorer) for mode in ("original", "compact")]
    return out


def settings(quick: bool, truncated: tuple[int, ...], scorers: tuple[str, ...] = ()) -> list[Setting]:
    out = []
    for mode in ("original", "compact"):
        for m in ((0.85,) if quick else (0.7, 0.85, 0.95)):
            out.append(Setting(f"mass{m}-{mode}", mode, Selection(mass=m)))
        for f in ((0.2,) if quick else (0.1, 0.2, 0.3)):
            out.append(Setting(f"chunk{f}-{mode}", mode, Selection(select_mode="chunk", keep_fraction=f)))
        for la in ((1,) if quick else (1, 4)):
            out.append(Setting(f"la{la}-{mode}", mode, lookahead=la))
        out.append(Setting(f"nopool-{mode}", mode, pool=0))
    out += [Setting(f"K{k}-original", scorer=f"K{k}") for k in truncated]
    return out + (scorer_settings(scorers) if scorers else [])


def kept_for(steps: list[np.ndarray], n: int, s: Setting, policy: PrefillPolicy,
             protected: tuple[tuple[int, int], ...] = ()) -> np.ndarray:
    """The tokens a setting keeps; ``protected``: the spans the guard keeps dense."""
    scores = importance(steps[: s.lookahead + 1], n, s.pool, policy.boost_first_n, policy.boost_first_mult,
                        policy.boost_last_n, policy.boost_last_mult, s.agg)
    return select_tokens(scores, s.selection, protected)


def with_answer_prefix(engine: Engine, prompt: Prompt, prefix: str) -> Prompt:
    """``prompt`` with the assistant's reply begun (after the generation prompt); the
    message spans, and so the guard's, stay those of the request."""
    extra = engine.target.tokenize(prefix, add_special=False, parse_special=False)
    return replace(prompt, tokens=prompt.tokens + tuple(extra))


def capture(engine: Engine, tokens: tuple[int, ...]) -> tuple[list[np.ndarray], float]:
    engine.speculator_ctx.clear_cells()
    t0 = time.perf_counter()
    steps = drive(engine.spec.capture_steps(SessionKV(), tokens, 8, Timings()))
    return steps, time.perf_counter() - t0


def answer(engine: Engine, tokens: tuple[int, ...], kept: np.ndarray, mode: str) -> tuple[str, float]:
    """The reply, and the target's prefill of ``kept`` in seconds."""
    engine.target_ctx.clear_cells()
    params = TurnParams(prefill=PrefillPolicy(position_mode=mode), sampling=ANSWER)
    timings = Timings()
    gen = drive(engine.prefill_and_decode(SessionKV(), tokens, kept, params, None, timings, tokens))
    return gen.text, timings.prompt_ms / 1000


def wilson(k: int, n: int) -> tuple[float, float]:
    if n == 0:
        return (0.0, 0.0)
    z, p = 1.96, k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(max(0.0, centre - half), 4), round(min(1.0, centre + half), 4))


def retention_ci(dense: list[bool], sparse: list[bool], rounds: int = 2000) -> tuple[float, float]:
    """Paired bootstrap over tasks of (sparse accuracy / dense accuracy)."""
    rng = random.Random(0)
    n, values = len(dense), []
    for _ in range(rounds):
        idx = [rng.randrange(n) for _ in range(n)]
        d = sum(dense[i] for i in idx)
        if d:
            values.append(sum(sparse[i] for i in idx) / d)
    values.sort()
    return (round(values[int(0.025 * len(values))], 4), round(values[int(0.975 * len(values)) - 1], 4)) \
        if values else (0.0, 0.0)


def run_eval(per_family: int, seed: int, words: int, quick: bool, truncated: tuple[int, ...], out: Path,
             early: tuple[str, ...] = (), only_scorers: bool = False, captures: tuple[str, ...] = ()) -> Any:
    """``early``: cheaper scorers (:func:`scorer_model`); ``only_scorers``: skip the policy grid;
    ``captures``: compare attention captures (:func:`capture_settings`) instead of policies."""
    from core.engine import Engine

    if captures:  # a capture comparison runs no other scorer
        truncated, early = (), ()
    cfg = model_files.with_default_models(EngineConfig(n_ctx=4096, calibrate_tokens=0, scorer="speculator-full",
                                                       attention_capture=captures[0] if captures else "auto"))
    target, speculator = cfg.target, cfg.speculator
    engine = Engine(cfg)
    paths = {**{f"K{k}": derived(k) for k in truncated}, **{name: scorer_model(name) for name in early}}
    scorers = {name: Engine(EngineConfig(target=str(p), speculator=str(p), n_ctx=4096, calibrate_tokens=0,
                                         scorer="speculator-full", scoring_window=window(name)))
               for name, p in paths.items()}
    scorers |= {f"capture-{kind}": Engine(EngineConfig(target=speculator, speculator=speculator, n_ctx=4096,
                                                       scorer="speculator-full",
                                                       calibrate_tokens=0, attention_capture=kind))
                for kind in captures[1:]}
    policy = PrefillPolicy()
    arms = (capture_settings(captures) if captures else
            scorer_settings(early) if only_scorers else settings(quick, truncated, early))
    reference = Setting("default", lookahead=policy.lookahead if captures else 8)  # overlaps are against it
    tasks = eval_tasks.generate(per_family, seed, words)
    rows = resumed(out / "eval.json", {"per_family": per_family, "seed": seed, "words": words}, arms)
    meta = {"params": {"per_family": per_family, "seed": seed, "words": words},
            "models": {"target": target, "speculator": speculator,
                       **{f"scorer_{name}": str(p) for name, p in paths.items()}}}
    try:
        for i, task in enumerate(tasks):
            if any(r["task"] == task.id for r in rows):
                continue  # measured by an earlier, stopped run of the same grid
            prompt = with_answer_prefix(engine, engine.chat.render_chat(task.messages,
                                                                   eval_tasks.TOOLS), task.answer_prefix)
            guard = engine.plan(prompt, replace(policy, min_tokens=0, break_even=False)).protected
            tokens, n = prompt.tokens, len(prompt)
            progress(f"eval task {i + 1}/{len(tasks)} {task.id} ({n} tokens)")
            dense_text, dense_s = answer(engine, tokens, np.arange(n), "original")
            rows.append(row(task, "dense", dense_text, n, n, 0.0, None, dense_s))
            steps = {"full": capture(engine, tokens)}
            for name, scorer in scorers.items():
                steps[name] = capture(scorer, tokens)
            full_default = kept_for(steps["full"][0], n, reference, policy, guard)
            answers: dict[tuple[str, bytes], tuple[str, float]] = {}  # arms that keep the same tokens answer alike
            for s in arms:
                kept = kept_for(steps[s.scorer][0], n, s, policy, guard)
                overlap = len(np.intersect1d(kept, full_default)) / len(full_default) if s.scorer != "full" else None
                key = (s.mode, kept.tobytes())
                if key not in answers:
                    answers[key] = answer(engine, tokens, kept, s.mode)
                text, prefill_s = answers[key]
                rows.append(row(task, s.name, text, n, int(kept.size), steps[s.scorer][1], overlap, prefill_s))
            done = [r for r in rows if r["task"] == task.id]
            progress("  " + " ".join(f"{r['setting']}={'+' if r['correct'] else '-'}" for r in done))
            save(rows, arms, meta, out)  # after every task: a stopped run keeps what it measured
    finally:
        engine.close()
        for scorer in scorers.values():
            scorer.close()
    from bench import plots  # matplotlib only when results are written

    summary = save(rows, arms, meta, out)
    plots.eval_accuracy(summary, out / "eval.png")
    if rule := adoption(summary):
        plots.scorer_cost(rule, out / "scorers.png")
    return summary


def resumed(path: Path, params: dict[str, Any], arms: list[Setting]) -> list[dict[str, Any]]:
    """The rows of an earlier run of the same grid (same tasks, same arms) at ``path``: a
    long grid can be stopped and continued."""
    import orjson

    if not path.exists():
        return []
    old = orjson.loads(path.read_bytes())
    same = all(old.get(k) == v for k, v in params.items()) and old.get("settings") == [asdict(s) for s in arms]
    if not same:
        return []
    done = {r["task"] for r in old["rows"] if r["setting"] == "dense"}
    complete = [t for t in done if sum(r["task"] == t for r in old["rows"]) == len(arms) + 1]
    progress(f"eval: resuming after {len(complete)} measured tasks in {path}")
    return [r for r in old["rows"] if r["task"] in complete]


def save(rows: list[dict[str, Any]], arms: list[Setting], meta: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    summary = summarize(rows, arms)
    write_result(out / "eval.json", "eval", {**meta["params"], "settings": [asdict(s) for s in arms],
                                           "rows": rows, "summary": summary, "adoption": adoption(summary)},
                 meta["models"])
    return summary


def row(task: eval_tasks.Task, setting: str, text: str, n: int, kept: int, scoring_s: float,
        overlap: float | None, prefill_s: float) -> dict[str, Any]:
    """``scoring_s``: the scorer's capture; ``prefill_s``: the target's prefill of the kept tokens."""
    return {"task": task.id, "family": task.family, "depth": task.depth, "setting": setting, "n_prompt": n,
            "n_kept": kept, "kept_fraction": round(kept / n, 4), "scoring_s": round(scoring_s, 3),
            "prefill_s": round(prefill_s, 3),
            "overlap_with_full": None if overlap is None else round(overlap, 4), "answer": text,
            "expected": task.expected, "correct": task.expected.lower() in text.lower()}


def summarize(rows: list[dict[str, Any]], arms: list[Setting]) -> list[dict[str, Any]]:
    dense = [r["correct"] for r in rows if r["setting"] == "dense"]
    out = []
    for s in [Setting("dense"), *arms]:
        mine = [r for r in rows if r["setting"] == s.name]
        hits = [r["correct"] for r in mine]
        k = sum(hits)
        acc = k / len(hits) if hits else 0.0
        overlaps = [r["overlap_with_full"] for r in mine if r["overlap_with_full"] is not None]
        out.append({
            "setting": s.name, "position_mode": s.mode, "n": len(hits), "accuracy": round(acc, 4),
            "ci95": wilson(k, len(hits)),
            "retention": round(acc / (sum(dense) / len(dense)), 4) if sum(dense) else None,
            "retention_ci95": retention_ci(dense, hits) if s.name != "dense" else None,
            "kept_fraction": round(float(np.mean([r["kept_fraction"] for r in mine])), 4),
            "scoring_s": round(float(np.mean([r["scoring_s"] for r in mine])), 3),
            "prefill_s": round(float(np.mean([r.get("prefill_s", 0.0) for r in mine])), 3),
            "overlap_with_full": round(float(np.mean(overlaps)), 4) if overlaps else None,
            "by_family": {f: round(sum(r["correct"] for r in mine if r["family"] == f)
                                   / max(1, sum(1 for r in mine if r["family"] == f)), 3)
                          for f in eval_tasks.FAMILIES},
        })
    return out
