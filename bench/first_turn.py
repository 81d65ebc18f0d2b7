"""First-turn TTFT versus prompt length: dense prefill against SpecPrefill in each
position mode, interleaved in one process (same engine, same warm caches)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import progress, write_result
from bench.textgen import WORDS_PER_TOKEN, build
from core.config import EngineConfig
from core.loader import override
from core.policies import PrefillPolicy, SamplingParams, TurnParams


def run(engine_cfg: EngineConfig, policy: PrefillPolicy, lengths: list[int], out: Path) -> list[dict[str, Any]]:
    from core.engine import Engine  # llama.cpp loads only when the bench runs

    cfg = override(engine_cfg, n_ctx=max(lengths) + 512)
    engine = Engine(cfg)
    forced = override(policy, min_tokens=0, break_even=False)
    rows = []
    try:
        for i, n in enumerate(lengths):
            doc = build(int(n * WORDS_PER_TOKEN), depth=0.4, seed=100 + i, key="amber locker", value=f"Q-{731 + i}")
            prompt = engine.chat.render(doc["messages"])
            would = engine.plan(prompt, policy).status.value
            order = [("dense", override(policy, enabled=False)),
                     ("original", override(forced, position_mode="original")),
                     ("compact", override(forced, position_mode="compact"))]
            order = order[i % 3:] + order[: i % 3]  # rotate so no arm always runs first
            for arm, pol in order:
                progress(f"first_turn: {len(prompt)} tokens, {arm}")
                r = engine.run(prompt, TurnParams(prefill=pol, sampling=SamplingParams(max_tokens=12)))
                t = r.timings
                rows.append({"target_tokens": n, "arm": arm, "planner_default": would,
                             "kept_pct": round(t.kept_pct, 2), **t.to_json(), "answer": r.text,
                             "correct": doc["expected"] in r.text})
                progress(f"  ttft {t.ttft_ms / 1e3:.1f}s kept {t.kept_pct:.0f}% answer {r.text.strip()[:30]!r}")
    finally:
        engine.close()
    summary = summarize(rows)
    write_result(out, "first_turn", {"policy": policy_dict(policy), "rows": rows, "summary": summary},
                 {"target": cfg.target, "speculator": cfg.speculator})
    return summary


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for n in sorted({r["target_tokens"] for r in rows}):
        by = {r["arm"]: r for r in rows if r["target_tokens"] == n}
        dense = by["dense"]["ttft_ms"]
        out.append({"target_tokens": n, "context_n": by["dense"]["context_n"], "dense_ttft_ms": round(dense, 1),
                    **{f"{m}_ttft_ms": round(by[m]["ttft_ms"], 1) for m in ("original", "compact")},
                    **{f"{m}_speedup": round(dense / by[m]["ttft_ms"], 3) for m in ("original", "compact")},
                    "kept_pct": by["original"]["kept_pct"], "planner_default": by["dense"]["planner_default"],
                    "all_correct": all(r["correct"] for r in by.values())})
    return out


def policy_dict(policy: PrefillPolicy) -> dict[str, Any]:
    from dataclasses import asdict
    return asdict(policy)
