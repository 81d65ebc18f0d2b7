import pytest

from core.config import PrefillPolicy
from core.guard import GuardVerdict, inspect, keyword_hits, scan_spans
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


def test_tool_guard_skip_and_structural():
    verdict = GuardVerdict(True, "request defines tools", ((0, 50),), "system prompt and tool definitions")
    skip = plan(5000, 5000, PrefillPolicy(min_tokens=0, guard_mode="skip"), verdict, SPEEDS)
    assert skip.status is Status.SKIPPED_TOOL_GUARD and not skip.score
    structural = plan(5000, 5000, PrefillPolicy(min_tokens=0), verdict, SPEEDS)
    assert structural.status is Status.ACTIVE and structural.score and structural.protected == ((0, 50),)
    assert "kept dense: system prompt and tool definitions" in structural.reason


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


def test_guard_keywords_and_triggers():
    assert keyword_hits('{"type": "function", "name": "get_weather"}', ['"function"', "get_"]) == \
        ['"function"', "get_"]
    policy = PrefillPolicy(guard_keywords=("get_",))
    plain = Prompt(tuple(range(100)), (Span("system", 0, 10), Span("user", 10, 100)))
    assert not inspect(plain, "You are a helpful assistant.", policy).triggered
    tooly = Prompt(tuple(range(100)), (Span("system", 0, 10), Span("user", 10, 60), Span("tool", 60, 100)))
    v = inspect(tooly, "You are a helpful assistant.", policy)
    assert v.triggered and "1 tool-role message(s)" in v.reason
    assert inspect(Prompt((1, 2), has_tools=True), "", policy).triggered
    assert inspect(Prompt((1, 2), has_grammar=True), "", policy).reason == "request carries a grammar"
    raw = inspect(Prompt(tuple(range(50))), "call search_docs(q)", PrefillPolicy(guard_scan_tokens=20))
    assert raw.triggered and raw.spans == ((0, 20),) and "prompt head mentions search_" in raw.reason


def test_keyword_scan_reads_the_system_prompt_not_the_document():
    chat = Prompt(tuple(range(300)), (Span("system", 0, 20), Span("user", 20, 300)))
    assert scan_spans(chat, 256) == ((0, 20),)  # a document full of get_/set_ is not scanned
    assert scan_spans(Prompt(tuple(range(300))), 256) == ((0, 256),)  # a raw prompt: its head
    no_system = Prompt(tuple(range(300)), (Span("user", 0, 300),))
    assert scan_spans(no_system, 256) == ()


def kept_by(spans: tuple[tuple[int, int], ...], n: int) -> set[int]:
    return {i for a, b in spans for i in range(a, min(b, n))}


def test_structural_guard_keeps_structure_and_frees_tool_results():
    # system+tools 0-300, task 300-340, assistant call 340-380, tool result 380-3380,
    # assistant call 3380-3420, tool result 3420-5420, generation prompt 5420-5423
    spans = (Span("system", 0, 300), Span("user", 300, 340), Span("assistant", 340, 380, tool_calls=True),
             Span("tool", 380, 3380), Span("assistant", 3380, 3420, tool_calls=True), Span("tool", 3420, 5420))
    prompt = Prompt(tuple(range(5423)), spans, has_tools=True)
    v = inspect(prompt, "", PrefillPolicy(guard_header_tokens=32))
    kept = kept_by(v.spans, len(prompt))
    assert v.triggered and "request defines tools" in v.reason and "2 tool-role message(s)" in v.reason
    assert set(range(0, 300)) <= kept  # system prompt and tool definitions
    assert set(range(300, 340)) <= kept  # the task: the latest user message, short, whole
    assert set(range(340, 380)) <= kept and set(range(3380, 3420)) <= kept  # both tool calls
    assert set(range(380, 412)) <= kept and set(range(3420, 3452)) <= kept  # tool-result headers
    assert set(range(3377, 3380)) <= kept  # the template tokens closing each result
    assert set(range(5420, 5423)) <= kept  # the generation prompt
    assert not kept & set(range(412, 3377)) and not kept & set(range(3452, 5417))  # result bodies are free
    assert "2 assistant tool call(s)" in v.kept and "2 tool-result header(s)" in v.kept
    assert len(kept) < 0.15 * len(prompt)


def test_structural_guard_on_a_long_user_document():
    # one long user message (a document with the question at its end): its tail stays dense
    prompt = Prompt(tuple(range(4003)), (Span("system", 0, 12), Span("user", 12, 4000)))
    v = inspect(prompt, "Be brief.", PrefillPolicy(guard_user_tokens=256))
    kept = kept_by(v.spans, len(prompt))
    assert not v.triggered  # no tools: the guard does not fire, the structure is still kept
    assert set(range(0, 16)) <= kept and set(range(3744, 4003)) <= kept
    assert not kept & set(range(16, 3744))
    assert "its last 256 tokens" in v.kept
