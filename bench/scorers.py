"""``specgate bench scorers``: first-turn TTFT of each scorer against dense, in one run.

The adoption rule's last test (issue 14): a cheaper scorer becomes the default only
if its first-turn speedup at 4K and 8K beats today's scorer's, measured in one
process.  Each arm is an engine on the same target with its own scoring model
(``--scorer``) and aggregation; per length, an agent-shaped prompt (tools, a task,
a tool call, one long tool result) runs dense once and then through every arm,
the order rotated per length.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.common import progress, write_result
from bench.textgen import WORDS_PER_TOKEN, agent_turn
from core.config import EngineConfig
from core.loader import override
from core.policies import PrefillPolicy, SamplingParams, TurnParams

TODAY = "speculator-full/max"  # the default scorer and aggregation


def parse_arms(text: str) -> list[tuple[str, str]]:
    """``scorer/agg,...`` -> [(scorer, agg)]; today's scorer is always an arm."""
    arms = [TODAY] + [a for a in text.split(",") if a and a != TODAY]
    return [(a.partition("/")[0], a.partition("/")[2] or "max") for a in arms]


def run(engine_cfg: EngineConfig, policy: PrefillPolicy, lengths: list[int], arms: list[tuple[str, str]],
        out: Path) -> list[dict[str, Any]]:
    from core.engine import Engine  # llama.cpp loads only when the bench runs

    base = override(engine_cfg, n_ctx=max(lengths) + 512, slots=1)
    forced = override(policy, min_tokens=0, break_even=False)
    engines = {f"{s}/{a}": (Engine(override(base, scorer=s)), override(forced, score_agg=a)) for s, a in arms}
    rows: list[dict[str, Any]] = []
    try:
        for i, n in enumerate(lengths):
            doc = agent_turn(int(n * WORDS_PER_TOKEN), depth=0.35, seed=500 + i, key=f"svc-{i}", value=f"S-{611 + i}")
            first = engines[TODAY][0]
            prompt = first.chat.render_chat(doc["messages"], doc["tools"])
            order = [("dense", first, override(policy, enabled=False))]
            order += [(name, eng, pol) for name, (eng, pol) in engines.items()]
            for arm, engine, pol in order[i % len(order):] + order[: i % len(order)]:
                progress(f"scorers: {len(prompt)} tokens, {arm}")
                r = engine.run(prompt, TurnParams(prefill=pol, sampling=SamplingParams(max_tokens=12)))
                t = r.timings
                rows.append({"target_tokens": n, "context_n": len(prompt), "arm": arm, "ttft_ms": round(t.ttft_ms, 1),
                             "scoring_ms": round(t.scoring_ms, 1), "prompt_ms": round(t.prompt_ms, 1),
                             "kept_pct": round(t.kept_pct, 2), "specprefill": t.specprefill, "answer": r.text,
                             "correct": doc["expected"] in r.text})
                progress(f"  ttft {t.ttft_ms / 1e3:.1f}s scoring {t.scoring_ms / 1e3:.1f}s kept {t.kept_pct:.0f}% "
                         f"answer {r.text.strip()[:24]!r}")
            write_result(out, "scorers", {"rows": rows, "summary": summarize(rows)},
                         {"target": base.target, "speculator": base.speculator})
    finally:
        for engine, _ in engines.values():
            engine.close()
    return summarize(rows)


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per length: each arm's speedup over dense, and whether it beats today's scorer."""
    out = []
    for n in sorted({r["target_tokens"] for r in rows}):
        by = {r["arm"]: r for r in rows if r["target_tokens"] == n}
        if "dense" not in by or TODAY not in by:
            continue
        dense = by["dense"]["ttft_ms"]
        speedups = {a: round(dense / r["ttft_ms"], 3) for a, r in by.items() if a != "dense"}
        out.append({"target_tokens": n, "context_n": by["dense"]["context_n"], "dense_ttft_ms": dense,
                    "speedup": speedups, "beats_today": {a: s > speedups[TODAY] for a, s in speedups.items()
                                                         if a != TODAY},
                    "correct": {a: r["correct"] for a, r in by.items()}})
    return out
