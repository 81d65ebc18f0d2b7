"""The eval harness's pure parts: task generation and the statistics."""

from __future__ import annotations

import numpy as np

from core.policies import PrefillPolicy, Selection
from evals.answer_quality import Setting, kept_for, retention_ci, settings, wilson
from evals.tasks import FAMILIES, TOOLS, generate


def test_tasks_are_deterministic_and_carry_their_answer():
    a, b = generate(2, 7, 300), generate(2, 7, 300)
    assert [t.messages for t in a] == [t.messages for t in b]
    assert {t.family for t in a} == set(FAMILIES) and len(a) == 10
    assert generate(1, 8, 300)[0].messages != a[0].messages
    for t in a:  # agent-shaped: question, the assistant's call, the long text as its tool result
        assert [m["role"] for m in t.messages] == ["system", "user", "assistant", "tool"], t.id
        call = t.messages[2]["tool_calls"][0]
        assert t.messages[3]["tool_call_id"] == call["id"]
        assert call["function"]["name"] in {tool["function"]["name"] for tool in TOOLS}
        assert t.expected in t.messages[3]["content"], t.id
        # the answer prefix starts the reply but never gives the answer away
        assert t.answer_prefix and t.expected.lower() not in t.answer_prefix.lower(), t.id


def test_wilson_interval():
    lo, hi = wilson(8, 10)
    assert 0.49 < lo < 0.5 and 0.94 < hi < 0.95
    assert wilson(0, 0) == (0.0, 0.0)
    assert wilson(10, 10)[1] == 1.0


def test_retention_ci_brackets_the_ratio():
    dense = [True] * 18 + [False] * 2
    sparse = [True] * 15 + [False] * 5
    lo, hi = retention_ci(dense, sparse)
    assert lo < 15 / 18 < hi <= 1.2


def test_kept_for_uses_only_the_requested_lookahead_steps():
    n = 256
    late = np.zeros((1, 1, n + 8), dtype=np.float32)
    late[0, 0, 192:224] = 1.0
    early = np.zeros((1, 1, n), dtype=np.float32)
    early[0, 0, 64:96] = 1.0
    steps = [early, late, late]
    policy = PrefillPolicy(boost_first_mult=1.0, boost_last_mult=1.0)
    one = kept_for(steps, n, Setting("x", lookahead=0, pool=0, selection=Selection(mass=0.5)), policy)
    assert set(range(64, 96)) <= set(one.tolist()) and 200 not in one
    more = kept_for(steps, n, Setting("x", lookahead=2, pool=0, selection=Selection(mass=0.5)), policy)
    assert set(range(192, 224)) <= set(more.tolist())


def test_grid_covers_the_issue_settings():
    names = {s.name for s in settings(False, (6, 12))}
    for mode in ("original", "compact"):
        for part in ("mass0.7", "mass0.85", "mass0.95", "chunk0.1", "chunk0.2", "chunk0.3", "la1", "la4", "nopool"):
            assert f"{part}-{mode}" in names
    assert {"K6-original", "K12-original"} <= names


def test_cheaper_scorer_arms_cover_aggregation_lookahead_and_positions():
    from evals.answer_quality import scorer_settings

    arms = scorer_settings(("S8", "T14"))
    names = {a.name for a in arms}
    assert "T14-filter-sum-la0-original" in names and "S8-max-la1-original" in names
    assert "T14-filter-sum-la1-compact" in names and "full-filter-sum-la1-original" in names
    assert "S8-filter-sum-la1-compact" not in names  # compact only at half depth
    assert len(arms) == 3 + 3 + 4 and {a.scorer for a in arms} == {"full", "S8", "T14"}


def test_a_stopped_grid_resumes_after_its_complete_tasks_only(tmp_path):
    from dataclasses import asdict

    import orjson

    from evals.answer_quality import Setting, resumed

    arms = [Setting("a"), Setting("b", lookahead=1)]
    params = {"per_family": 2, "seed": 29, "words": 800}
    rows = [{"task": "t1", "setting": s} for s in ("dense", "a", "b")] + [{"task": "t2", "setting": "dense"}]
    doc = {**params, "settings": [asdict(s) for s in arms], "rows": rows}
    path = tmp_path / "eval.json"
    path.write_bytes(orjson.dumps(doc))
    assert [r["task"] for r in resumed(path, params, arms)] == ["t1"] * 3  # t2 stopped midway: measured again
    assert resumed(path, {**params, "seed": 30}, arms) == []  # another task set
    assert resumed(path, params, arms[:1]) == []  # another grid
    assert resumed(tmp_path / "none.json", params, arms) == []
