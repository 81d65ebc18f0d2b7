from evals.scorer_adoption import adoption


def arm(name, scoring_s, retention, ci, prefill_s=2.0, kept=0.2):
    return {"setting": name, "scoring_s": scoring_s, "prefill_s": prefill_s, "retention": retention,
            "retention_ci95": ci, "kept_fraction": kept}


SUMMARY = [
    {"setting": "dense", "scoring_s": 0.0, "prefill_s": 20.0, "retention": 1.0, "retention_ci95": None,
     "kept_fraction": 1.0},
    arm("full-max-la1-original", 10.0, 1.0, (0.8, 1.2)),
    arm("S8-filter-sum-la1-original", 3.0, 0.9, (0.7, 1.0)),  # cheap and reaches dense: selectable
    arm("S12-max-la1-original", 5.0, 0.5, (0.2, 0.8)),  # cheap but loses answers
    arm("S16-max-la1-original", 5.5, 0.7, (0.4, 1.0)),  # its interval reaches 1.0, but it lost 3 in 10
    arm("T19-filter-sum-la1-original", 8.0, 1.0, (0.9, 1.1)),  # as good, too dear
]


def test_the_rule_needs_both_retention_and_cost():
    rows = {r["setting"]: r for r in adoption(SUMMARY)}
    assert set(rows) == {"full-max-la1-original", "S8-filter-sum-la1-original", "S12-max-la1-original",
                         "S16-max-la1-original", "T19-filter-sum-la1-original"}
    assert [n for n, r in rows.items() if r["selectable"]] == ["S8-filter-sum-la1-original"]
    s8 = rows["S8-filter-sum-la1-original"]
    assert (s8["cost_vs_today"], s8["cost_vs_dense"], s8["est_speedup"]) == (0.3, 0.15, 4.0)
    assert rows["S12-max-la1-original"]["why"] == \
        "retention interval below dense, retention 0.5 < 0.9, cost 0.50 <= 0.6"
    assert rows["T19-filter-sum-la1-original"]["why"] == \
        "retention interval reaches dense, retention 1.0 >= 0.9, cost 0.80 > 0.6"
    s16 = rows["S16-max-la1-original"]
    assert s16["as_written"] and not s16["selectable"]
    assert rows["full-max-la1-original"]["selectable"] is False  # today's scorer costs 1.0 of itself


def test_no_baseline_no_verdict():
    assert adoption([r for r in SUMMARY if r["setting"] != "full-max-la1-original"]) == []
    assert adoption([r for r in SUMMARY if r["setting"] != "dense"]) == []
