"""``specgate bench planner``: does the planner pick the faster path?

For each prompt length, an agent-shaped prompt (tools, a task, a tool call and a
long tool result) runs dense and with SpecPrefill (forced on), interleaved in
one process.  Before each length the planner's decision is recorded twice: as
this engine decides after what it has measured so far, and as a fresh engine
(calibration only) would.  A decision is right when it picks the path whose
measured TTFT is lower; lengths where the two differ by under 10% count as ties.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from bench.common import progress, write_result
from bench.textgen import WORDS_PER_TOKEN, agent_turn, code_turn
from core.config import EngineConfig
from core.loader import override
from core.policies import PrefillPolicy, SamplingParams, TurnParams
from core.specprefill.cost_model import Costs

TIE = 0.10


CONTENTS = ("logs", "code")  # what the long tool result holds: filler log prose, or Python source


def prompt_doc(content: str, n: int, i: int) -> dict[str, Any]:
    if content == "code":
        return code_turn(n, depth=0.35, key=f"svc-{i}", value=f"T-{517 + i}")
    return agent_turn(int(n * WORDS_PER_TOKEN), depth=0.35, seed=300 + i, key=f"svc-{i}", value=f"T-{517 + i}")


def run(engine_cfg: EngineConfig, policy: PrefillPolicy, lengths: list[int], out: Path,
        content: str = "logs") -> list[dict[str, Any]]:
    from core.engine import Engine  # llama.cpp loads only when the bench runs

    cfg = override(engine_cfg, n_ctx=max(lengths) + 512)
    engine = Engine(cfg)
    fresh = copy.deepcopy(engine.costs)  # what the planner knows from calibration alone
    rows: list[dict[str, Any]] = []
    try:
        for i, n in enumerate(lengths):
            doc = prompt_doc(content, n, i)
            prompt = engine.chat.render_chat(doc["messages"], doc["tools"])
            row: dict[str, Any] = {"content": content, "scorer": cfg.scorer, "target_tokens": n,
                                   "context_n": len(prompt),
                                   "planner": engine.plan(prompt, policy).status.value,
                                   "planner_fresh": engine.plan(prompt, policy, costs=fresh).status.value,
                                   "costs": costs_json(engine.costs)}
            arms = [("dense", override(policy, enabled=False)),
                    ("specprefill", override(policy, min_tokens=0, break_even=False))]
            for arm, pol in arms if i % 2 == 0 else arms[::-1]:
                progress(f"planner: {len(prompt)} tokens, {arm}")
                r = engine.run(prompt, TurnParams(prefill=pol, sampling=SamplingParams(max_tokens=12)))
                row[arm] = {**r.timings.to_json(), "answer": r.text, "correct": doc["expected"] in r.text}
                progress(f"  ttft {r.timings.ttft_ms / 1e3:.1f}s kept {r.timings.kept_pct:.0f}% "
                         f"answer {r.text.strip()[:24]!r}")
            rows.append(judge(row))
            write_result(out, "planner", {"content": content, "policy": policy_json(policy), "rows": rows,
                                          "summary": summary(rows)},
                         {"target": cfg.target, "speculator": cfg.speculator})
    finally:
        engine.close()
    return rows


def judge(row: dict[str, Any]) -> dict[str, Any]:
    """Which path was faster, by how much, and whether each planner decision picked it."""
    dense, sparse = row["dense"]["ttft_ms"], row["specprefill"]["ttft_ms"]
    faster = "specprefill" if sparse < dense else "dense"
    gap = abs(dense - sparse) / max(dense, sparse)
    out = {**row, "faster": faster, "gap": round(gap, 4), "speedup": round(dense / sparse, 3), "tie": gap < TIE}
    for key in ("planner", "planner_fresh"):
        chose = "specprefill" if row[key] in ("active", "kept_all") else "dense"
        out[f"{key}_right"] = chose == faster or gap < TIE
    return out


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    decided = [r for r in rows if not r["tie"]]
    return {"lengths": len(rows), "clear_cases": len(decided),
            "planner_right": sum(r["planner_right"] for r in decided),
            "planner_fresh_right": sum(r["planner_fresh_right"] for r in decided),
            "answers_equal": sum(r["dense"]["correct"] == r["specprefill"]["correct"] for r in rows)}


def costs_json(costs: Costs) -> dict[str, Any]:
    """The cost model the planner decided with: a, b, d per model and the selection priors."""
    return {"target": costs.target.coef.tolist(), "speculator": costs.speculator.coef.tolist(),
            "speculator_step": costs.speculator_step.coef.tolist(),
            "kept_ratios": {k.value: round(v, 4) for k, v in costs.kept_ratios.items()},
            "run_tokens": round(costs.run_tokens, 1),
            "shift_s": {"target": round(costs.target.shift_s, 4), "speculator": round(costs.speculator.shift_s, 4)},
            "move_s_per_cell": {"target": costs.target.move_s_per_cell, "speculator": costs.speculator.move_s_per_cell}}


def policy_json(policy: PrefillPolicy) -> dict[str, Any]:
    from dataclasses import asdict
    return asdict(policy)
