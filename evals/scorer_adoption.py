"""The cheaper-scorer adoption rule (issue 14), applied to an eval summary (pure).

A scorer arm is *selectable* when its paired retention interval against dense
reaches 1.0 (dense's own retention) and its scoring costs at most ``max_cost`` of
today's scorer's, both measured in the same run.  On ten tasks that interval
cannot exclude 1.0 even for an arm that lost three answers dense gave, so the
point retention must also be at least ``min_retention`` (at most one lost answer
in ten); ``as_written`` records the verdict without that floor.  Whether a selectable arm
becomes the default is decided by first-turn TTFT at 4K and 8K (``specgate
bench first_turn``), not here.
"""

from __future__ import annotations

from typing import Any

TODAY = "full-max-la1-original"  # the default scorer: the whole speculator, max over heads and layers
MAX_COST = 0.6
MIN_RETENTION = 0.9


def adoption(summary: list[dict[str, Any]], max_cost: float = MAX_COST,
             min_retention: float = MIN_RETENTION) -> list[dict[str, Any]]:
    """One row per scorer arm: its cost against today's scorer and dense prefill, its
    retention interval, an estimated TTFT ratio, and whether the rule selects it."""
    by_name = {r["setting"]: r for r in summary}
    today, dense = by_name.get(TODAY), by_name.get("dense")
    if not today or not dense or not today["scoring_s"] or not dense["prefill_s"]:
        return []
    out = []
    for r in summary:
        if r["setting"] == "dense" or r.get("retention_ci95") is None:
            continue
        cost = r["scoring_s"] / today["scoring_s"]
        reaches_dense = r["retention_ci95"][1] >= 1.0
        cheap, close = cost <= max_cost, (r["retention"] or 0.0) >= min_retention
        out.append({
            "setting": r["setting"],
            "cost_vs_today": round(cost, 3),
            "cost_vs_dense": round(r["scoring_s"] / dense["prefill_s"], 3),
            "retention": r["retention"],
            "retention_ci95": r["retention_ci95"],
            "kept_fraction": r["kept_fraction"],
            # what a first turn of this length would take against dense: scoring + the sparse prefill
            "est_speedup": round(dense["prefill_s"] / (r["scoring_s"] + r["prefill_s"]), 3),
            "as_written": bool(reaches_dense and cheap),
            "selectable": bool(reaches_dense and cheap and close),
            "why": ", ".join([
                "retention interval reaches dense" if reaches_dense else "retention interval below dense",
                f"retention {r['retention']} {'>=' if close else '<'} {min_retention}",
                f"cost {cost:.2f} {'<=' if cheap else '>'} {max_cost}"]),
        })
    return out
