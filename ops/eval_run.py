"""``specgate eval``: answer accuracy of dense prefill against SpecPrefill settings.

Per task the target runs dense once; the speculator captures attention once
(lookahead 8), and lookahead 1/4/8 and pooling on/off are derived from those
captured steps; each setting then costs one sparse target pass.  Layer-truncated
scorers (the first K blocks of the speculator) run as extra arms with their
scoring time and the overlap of their kept set with the full scorer's.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core import model_store
from core.config import EngineConfig, PolicyConfig, SamplingParams
from core.engine import Engine, Timings
from core.kv_state import SeqState, SessionKV
from core.scoring import importance
from core.selection import select_tokens
from ops import eval_tasks
from ops.bench import derived
from ops.bench_common import progress, write_result

ANSWER = SamplingParams(max_tokens=12)


@dataclass(slots=True, frozen=True)
class Setting:
    name: str
    mode: str = "original"
    select_mode: str = "mass"
    mass: float = 0.85
    fraction: float = 0.3
    lookahead: int = 8
    pool: int = 13
    scorer: str = "full"


def settings(quick: bool, truncated: tuple[int, ...]) -> list[Setting]:
    out = []
    for mode in ("original", "compact"):
        for m in ((0.85,) if quick else (0.7, 0.85, 0.95)):
            out.append(Setting(f"mass{m}-{mode}", mode, "mass", mass=m))
        for f in ((0.2,) if quick else (0.1, 0.2, 0.3)):
            out.append(Setting(f"chunk{f}-{mode}", mode, "chunk", fraction=f))
        for la in ((1,) if quick else (1, 4)):
            out.append(Setting(f"la{la}-{mode}", mode, lookahead=la))
        out.append(Setting(f"nopool-{mode}", mode, pool=0))
    out += [Setting(f"K{k}-original", scorer=f"K{k}") for k in truncated]
    return out


def kept_for(steps: list[np.ndarray], n: int, s: Setting, policy: PolicyConfig) -> np.ndarray:
    scores = importance(steps[: s.lookahead + 1], n, s.pool, policy.boost_first_n, policy.boost_first_mult,
                        policy.boost_last_n, policy.boost_last_mult)
    return select_tokens(scores, chunk=policy.chunk_size, mode=s.select_mode, mass=s.mass, fraction=s.fraction,
                         keep_first=policy.keep_first, keep_last=policy.keep_last)


def capture(engine: Engine, tokens: tuple[int, ...]) -> tuple[list[np.ndarray], float]:
    engine.spec_ctx.clear()
    t0 = time.perf_counter()
    steps = engine.capture_steps(SeqState(), tokens, 8, Timings())
    return steps, time.perf_counter() - t0


def answer(engine: Engine, tokens: tuple[int, ...], kept: np.ndarray, mode: str) -> str:
    engine.target_ctx.clear()
    gen = engine.prefill_and_decode(SessionKV(), tokens, kept, PolicyConfig(position_mode=mode), ANSWER, None,
                                    Timings(), tokens)
    return gen.text


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


def run_eval(per_family: int, seed: int, words: int, quick: bool, truncated: tuple[int, ...], out: Path) -> Any:
    target = str(model_store.model_path(model_store.TARGET))
    speculator = str(model_store.model_path(model_store.SPECULATOR))
    engine = Engine(EngineConfig(target=target, speculator=speculator, n_ctx=4096, calibrate_tokens=0))
    scorers = {f"K{k}": Engine(EngineConfig(target=derived(k), speculator=derived(k), n_ctx=4096,
                                            calibrate_tokens=0)) for k in truncated}
    policy = PolicyConfig()
    arms = settings(quick, truncated)
    tasks = eval_tasks.generate(per_family, seed, words)
    rows: list[dict[str, Any]] = []
    meta = {"params": {"per_family": per_family, "seed": seed, "words": words},
            "models": {"target": target, "speculator": speculator,
                       **{f"scorer_K{k}": derived(k) for k in truncated}}}
    try:
        for i, task in enumerate(tasks):
            prompt = engine.chat.render(list(task.messages))
            tokens, n = prompt.tokens, len(prompt)
            progress(f"eval task {i + 1}/{len(tasks)} {task.id} ({n} tokens)")
            dense_text = answer(engine, tokens, np.arange(n), "original")
            rows.append(row(task, "dense", dense_text, n, n, 0.0, None))
            steps = {"full": capture(engine, tokens)}
            for name, scorer in scorers.items():
                steps[name] = capture(scorer, tokens)
            full_default = kept_for(steps["full"][0], n, Setting("default"), policy)
            for s in arms:
                kept = kept_for(steps[s.scorer][0], n, s, policy)
                overlap = len(np.intersect1d(kept, full_default)) / len(full_default) if s.scorer != "full" else None
                rows.append(row(task, s.name, answer(engine, tokens, kept, s.mode), n, int(kept.size),
                                steps[s.scorer][1], overlap))
            done = [r for r in rows if r["task"] == task.id]
            progress("  " + " ".join(f"{r['setting']}={'+' if r['correct'] else '-'}" for r in done))
            save(rows, arms, meta, out)  # after every task: a stopped run keeps what it measured
    finally:
        engine.close()
        for scorer in scorers.values():
            scorer.close()
    from ops import plots  # matplotlib only when results are written

    summary = save(rows, arms, meta, out)
    plots.eval_accuracy(summary, out / "eval.png")
    return summary


def save(rows: list[dict[str, Any]], arms: list[Setting], meta: dict[str, Any], out: Path) -> list[dict[str, Any]]:
    summary = summarize(rows, arms)
    write_result(out / "eval.json", "eval", {**meta["params"], "settings": [asdict(s) for s in arms],
                                           "rows": rows, "summary": summary}, meta["models"])
    return summary


def row(task: eval_tasks.Task, setting: str, text: str, n: int, kept: int, scoring_s: float,
        overlap: float | None) -> dict[str, Any]:
    return {"task": task.id, "family": task.family, "depth": task.depth, "setting": setting, "n_prompt": n,
            "n_kept": kept, "kept_fraction": round(kept / n, 4), "scoring_s": round(scoring_s, 3),
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
            "overlap_with_full": round(float(np.mean(overlaps)), 4) if overlaps else None,
            "by_family": {f: round(sum(r["correct"] for r in mine if r["family"] == f)
                                   / max(1, sum(1 for r in mine if r["family"] == f)), 3)
                          for f in eval_tasks.FAMILIES},
        })
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--per-family", type=int, default=5, help="tasks per family (5 families)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--words", type=int, default=800, help="filler words per task (~1.14 tokens each)")
    parser.add_argument("--quick", action="store_true", help="1 task per family and a small grid")
    parser.add_argument("--truncated", default="6,12", help="layer-truncated scorers to test (blocks), '' for none")
    parser.add_argument("--out", default="results/eval")
    from ops import eval_specattn
    eval_specattn.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import orjson

    if args.specattn:
        from ops import eval_specattn
        print(orjson.dumps(eval_specattn.run_specattn(args), option=orjson.OPT_INDENT_2).decode())
        return 0
    per_family = 1 if args.quick else args.per_family
    truncated = tuple(int(x) for x in args.truncated.split(",") if x)
    summary = run_eval(per_family, args.seed, args.words, args.quick, truncated, Path(args.out))
    print(orjson.dumps(summary, option=orjson.OPT_INDENT_2).decode())
    return 0
