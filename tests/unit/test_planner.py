import pytest

from core.config import PrefillPolicy
from core.guard import GuardVerdict, inspect, keyword_hits
from core.planner import Status, Throughput, break_even, plan
from core.prompt import Prompt, Span

CLEAR = GuardVerdict(False)
SPEEDS = Throughput(speculator_prefill_tps=100.0, speculator_step_s=0.05, target_prefill_tps=40.0, kept_ratio=0.2)


def test_disabled_first():
    p = plan(5000, 5000, PrefillPolicy(enabled=False), GuardVerdict(True, "tools"), SPEEDS)
    assert p.status is Status.DISABLED and not p.score


def test_min_tokens():
    p = plan(100, 100, PrefillPolicy(min_tokens=512), CLEAR, SPEEDS)
    assert p.status is Status.SKIPPED_MIN_TOKENS
    assert "100" in p.reason and "512" in p.reason


def test_tool_guard_skip_and_conservative():
    verdict = GuardVerdict(True, "request defines tools", ((0, 50),))
    skip = plan(5000, 5000, PrefillPolicy(min_tokens=0), verdict, SPEEDS)
    assert skip.status is Status.SKIPPED_TOOL_GUARD and not skip.score
    cons = plan(5000, 5000, PrefillPolicy(min_tokens=0, guard_mode="conservative"), verdict, SPEEDS)
    assert cons.status is Status.ACTIVE and cons.score and cons.protected == ((0, 50),)


def test_break_even_uses_measured_speeds():
    # scoring 3000/100 + 9*0.05 = 30.45 s; saved 3000*0.8/40 = 60 s >= 30.45*1.2
    est = break_even(3000, 3000, 8, SPEEDS, 1.2)
    assert est.scoring_s == pytest.approx(30.45)
    assert est.saved_s == pytest.approx(60.0)
    assert est.worth_it
    # a speculator as slow as the target can never pay back
    slow = Throughput(speculator_prefill_tps=40.0, speculator_step_s=0.05, target_prefill_tps=40.0, kept_ratio=0.2)
    p = plan(3000, 3000, PrefillPolicy(min_tokens=0), CLEAR, slow)
    assert p.status is Status.SKIPPED_BREAK_EVEN and not p.score


def test_break_even_off_or_uncalibrated_scores():
    slow = Throughput(speculator_prefill_tps=40.0, speculator_step_s=0.05, target_prefill_tps=40.0)
    assert plan(3000, 3000, PrefillPolicy(min_tokens=0, break_even=False), CLEAR, slow).status is Status.ACTIVE
    assert plan(3000, 3000, PrefillPolicy(min_tokens=0), CLEAR, Throughput()).status is Status.ACTIVE


def test_throughput_running_average():
    t = Throughput(alpha=0.5)
    t.observe_target_prefill(100, 1.0)
    t.observe_target_prefill(300, 1.0)
    assert t.target_prefill_tps == pytest.approx(200.0)
    t.observe_target_prefill(5, 1.0)  # too short to be a throughput sample
    assert t.target_prefill_tps == pytest.approx(200.0)


def test_status_strings_match_the_seed():
    assert {s.value for s in Status} == {"disabled", "skipped_min_tokens", "skipped_tool_guard",
                                         "skipped_break_even", "kept_all", "active"}


def test_guard_keywords_and_roles():
    assert keyword_hits('{"type": "function", "name": "get_weather"}', ['"function"', "get_"]) == \
        ['"function"', "get_"]
    plain = Prompt(tuple(range(100)), (Span("system", 0, 10), Span("user", 10, 100)))
    assert not inspect(plain, "You are a helpful assistant.", 100, ["get_"]).triggered
    tooly = Prompt(tuple(range(100)), (Span("system", 0, 10), Span("user", 10, 60), Span("tool", 60, 100)))
    v = inspect(tooly, "You are a helpful assistant.", 100, ["get_"])
    assert v.triggered and "tool-role" in v.reason and v.spans == ((0, 10), (60, 100))
    assert inspect(Prompt((1, 2), has_tools=True), "", 2, []).triggered
    assert inspect(Prompt((1, 2), has_grammar=True), "", 2, []).reason == "request carries a grammar"
    raw = inspect(Prompt(tuple(range(50))), "call search_docs(q)", 20, ["search_"])
    assert raw.triggered and raw.spans == ((0, 20),)
