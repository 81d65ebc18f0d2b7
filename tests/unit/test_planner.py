import math
from dataclasses import replace

import numpy as np
import pytest

from core.kv.positions import TokenCells, cached_indices, plan_speculator_sync
from core.policies import PrefillPolicy
from core.prompt import Prompt, Span
from core.results import Status
from core.specprefill.content import ContentKind
from core.specprefill.cost_model import Costs, PrefillCost, Work, attended, estimate, features
from core.specprefill.guard import GuardVerdict, inspect, keyword_hits, scan_spans
from core.specprefill.planner import plan

CLEAR = GuardVerdict(False)
def linear(per_token: float) -> PrefillCost:
    """A cost with weights only: ``per_token`` seconds a token, no attention, no call overhead."""
    return PrefillCost(coef=np.array([per_token, 0.0, 0.0]))


def work(n: int, protected: int = 0, lookahead: int = 8, n_batch: int = 512) -> Work:
    return Work(n_select=n, n_protected=protected, target_cached=0, n_score=n, speculator_cached=0,
                lookahead=lookahead, n_batch=n_batch, compact=False)


SPEEDS = Costs(target=PrefillCost(coef=np.array([0.025, 0.0, 0.01])), speculator=linear(0.01),
               speculator_step=linear(0.01), run_tokens=64.0)


def test_disabled_first():
    p = plan(work(5000), PrefillPolicy(enabled=False), GuardVerdict(True, "tools"), SPEEDS)
    assert p.status is Status.DISABLED and not p.score


def test_min_tokens():
    p = plan(work(100), PrefillPolicy(min_tokens=512), CLEAR, SPEEDS)
    assert p.status is Status.SKIPPED_MIN_TOKENS
    assert "100" in p.reason and "512" in p.reason


def test_tool_guard_skip_and_structural():
    verdict = GuardVerdict(True, "request defines tools", ((0, 50),), "system prompt and tool definitions")
    skip = plan(work(5000), PrefillPolicy(min_tokens=0, guard_mode="skip"), verdict, SPEEDS)
    assert skip.status is Status.SKIPPED_TOOL_GUARD and not skip.score
    structural = plan(work(5000), PrefillPolicy(min_tokens=0), verdict, SPEEDS)
    assert structural.status is Status.ACTIVE and structural.score and structural.protected == ((0, 50),)
    assert "kept dense: system prompt and tool definitions" in structural.reason


def test_break_even_compares_dense_with_scoring_plus_sparse():
    est = estimate(work(3000), SPEEDS)
    # dense 3000 x 25 ms = 75 s; kept 15% = 450 tokens, 7 runs: 11.25 s + 0.07 s;
    # scoring: 2999 x 10 ms + 9 steps x 10 ms = 30.08 s
    assert est.dense_s == pytest.approx(75.06) and est.kept == 450
    assert est.sparse_s == pytest.approx(11.32) and est.scoring_s == pytest.approx(30.08)
    assert plan(work(3000), PrefillPolicy(min_tokens=0), CLEAR, SPEEDS).status is Status.ACTIVE
    # a speculator as slow as the target can never pay back
    slow = Costs(target=linear(0.025), speculator=linear(0.025), speculator_step=linear(0.025))
    p = plan(work(3000), PrefillPolicy(min_tokens=0), CLEAR, slow)
    assert p.status is Status.SKIPPED_BREAK_EVEN and not p.score and "dense ~75" in p.reason


def test_protected_tokens_are_not_savings():
    free = estimate(work(3000), SPEEDS)
    guarded = estimate(work(3000, protected=2000), SPEEDS)
    assert guarded.kept == 2000 + 150 and guarded.saved_s < free.saved_s / 2


def test_break_even_off_or_uncalibrated_scores():
    slow = Costs(target=linear(0.025), speculator=linear(0.025), speculator_step=linear(0.025))
    assert plan(work(3000), PrefillPolicy(min_tokens=0, break_even=False), CLEAR, slow).status is Status.ACTIVE
    assert plan(work(3000), PrefillPolicy(min_tokens=0), CLEAR, Costs()).status is Status.ACTIVE


def test_cost_fit_recovers_weights_attention_and_call_overhead():
    truth = np.array([0.02, 2e-6, 0.05])
    cost = PrefillCost()
    for m, c, calls in [(128, 0, 1), (1, 128, 1), (512, 0, 1), (2048, 0, 4), (1, 4096, 1), (300, 6000, 10),
                        (4000, 0, 8), (32, 2000, 1)]:
        cost.observe(m, c, calls, float(features(m, c, calls) @ truth))
    np.testing.assert_allclose(cost.coef, truth, rtol=0.05)
    assert cost.seconds(8000) == pytest.approx(8000 * 0.02 + 8000 * 3999.5 * 2e-6 + 0.05, rel=0.05)


def test_bridge_tokens_is_the_gap_a_pass_overhead_pays_for():
    cost = PrefillCost(coef=np.array([0.01, 1e-6, 0.5]))
    assert cost.bridge_tokens(0) == 50  # 0.5 s of a pass buys 50 tokens at 10 ms
    assert cost.bridge_tokens(10_000) == 25  # at 20 ms a token further into the context
    assert PrefillCost().bridge_tokens(0) == 0  # nothing measured: bridge nothing
    shifting = PrefillCost(coef=np.array([0.01, 0.0, 0.0]), shift_s=0.3, move_s_per_cell=math.inf)  # shared cells
    assert shifting.bridge_tokens(0) == 30  # a K-shift alone pays for 30 tokens
    assert shifting.sparse_seconds(100, 0, 4) == pytest.approx(1.0 + 3 * 0.3)  # 3 shifts for 4 runs


def test_a_bridge_moves_a_label_while_that_is_cheaper_than_a_k_shift():
    """Moving a label copies the sequence's cells, so it costs in proportion to them; a
    K-shift costs the whole context's cells whatever the sequence holds."""
    cost = PrefillCost(coef=np.array([0.01, 0.0, 0.0]), shift_s=1.0, move_s_per_cell=1e-4)
    assert cost.relabels(1_000) and cost.bridge_s(1_000) == pytest.approx(0.1)
    assert not cost.relabels(20_000) and cost.bridge_s(20_000) == 1.0  # past 10,000 cells the K-shift wins
    assert cost.sparse_seconds(1_000, 0, 4) == pytest.approx(10.0 + 3 * 0.05)  # 500 cells on average
    assert cost.bridge_tokens(1_000) == 10  # a 0.1 s move pays for 10 tokens, a K-shift would for 100
    assert not PrefillCost(shift_s=1.0, move_s_per_cell=math.inf).relabels(10)  # shared cells: K-shifts
    assert PrefillCost().relabels(10) and PrefillCost().bridge_s(10) == 0  # nothing measured: the exact way


def test_a_move_through_the_scratch_sequence_costs_the_same_at_any_depth():
    """Where slots share cells the moved cell alone is copied: a fixed cost per move."""
    cost = PrefillCost(coef=np.array([0.01, 0.0, 0.0]), shift_s=1.0, move_s=0.004)
    assert cost.relabels(100) and cost.relabels(100_000)
    assert cost.bridge_s(100_000) == pytest.approx(0.004) and cost.bridge_tokens(100_000) == 0
    assert not PrefillCost(shift_s=0.001, move_s=0.004).relabels(10)  # a K-shift cheaper still wins



def test_moves_timed_at_depth_teach_what_a_move_costs_there():
    """Start-up times one move in 130 cells. A sparse prefill's moves, timed where the
    sequence is long, replace that guess: here they cost 3x per cell, so past ~4,200 cells the
    K-shift wins, where the start-up figure would have moved labels up to 12,500 cells."""
    cost = PrefillCost(coef=np.array([0.01, 0.0, 0.0]), shift_s=1.0, move_s_per_cell=8e-5)
    assert cost.relabels(10_000)
    cost.observe_moves(10, 5_000, 10 * 5_000 * 2.4e-4)  # ten moves at 240 us a cell
    assert cost.move_s_per_cell == pytest.approx(1.6e-4)  # halfway: one prefill's moves are not the last word
    cost.observe_moves(10, 5_000, 10 * 5_000 * 2.4e-4)
    assert cost.move_s_per_cell == pytest.approx(2.0e-4)
    assert not cost.relabels(10_000) and cost.bridge_s(10_000) == 1.0
    assert cost.relabels(4_000)


def test_moves_through_the_scratch_sequence_are_learned_per_move_and_nothing_else_changes():
    shared = PrefillCost(shift_s=1.0, move_s=0.004)
    shared.observe_moves(4, 20_000, 4 * 0.012)
    assert shared.move_s == pytest.approx(0.008) and shared.move_s_per_cell == 0
    cannot = PrefillCost(shift_s=1.0, move_s_per_cell=math.inf)  # the context cannot move labels
    cannot.observe_moves(3, 1_000, 0.5)
    assert cannot.move_s_per_cell == math.inf and cannot.move_s == 0
    idle = PrefillCost(shift_s=1.0, move_s_per_cell=8e-5)
    idle.observe_moves(0, 1_000, 0.0)  # a dense prefill: no moves, nothing learned
    assert idle.move_s_per_cell == 8e-5

def test_break_even_charges_a_k_shift_per_extra_run():
    cheap, dear = replace(SPEEDS, run_tokens=8.0), replace(SPEEDS, run_tokens=8.0)
    dear.target = replace(SPEEDS.target, shift_s=2.0, move_s_per_cell=math.inf)
    assert plan(work(3000), PrefillPolicy(), CLEAR, cheap).status is Status.ACTIVE
    slow = plan(work(3000), PrefillPolicy(), CLEAR, dear)  # ~45 runs of 8 kept tokens, 2 s of K-shift each
    assert slow.status is Status.SKIPPED_BREAK_EVEN


def test_break_even_expects_code_to_keep_more_than_logs():
    """The same length pays on logs and not on code, whose selections keep ~3x more: with
    scoring at 0.72 of dense, logs save ~66 s of 75 and code ~49 s, against ~54 s of scoring."""
    costs = replace(SPEEDS, speculator=linear(0.018))
    logs = plan(replace(work(3000), kind=ContentKind.LOGS), PrefillPolicy(), CLEAR, costs)
    code = plan(replace(work(3000), kind=ContentKind.CODE), PrefillPolicy(), CLEAR, costs)
    assert logs.status is Status.ACTIVE and logs.kind is ContentKind.LOGS
    assert code.status is Status.SKIPPED_BREAK_EVEN and "of code" in code.reason


def test_each_kind_learns_its_own_kept_share():
    costs = Costs()
    for _ in range(20):
        costs.observe_selection(1000, 500, 520, 10, ContentKind.CODE)
    assert costs.kept_ratio(ContentKind.CODE) == pytest.approx(0.5, abs=0.01)
    assert costs.kept_ratio(ContentKind.LOGS) == 0.12  # untouched by code


def test_a_long_prompt_is_not_skipped_when_measured_speeds_say_it_pays():
    """The reported failure: calibrated on a short prompt and a linear model, the planner
    skipped an 8K prompt that ran far faster with SpecPrefill.  Measured costs with attention
    (the speculator runs without flash attention, so its attention term is the larger one)."""
    target = PrefillCost()
    speculator = PrefillCost()
    t_true, s_true = np.array([0.006, 7e-7, 0.02]), np.array([0.0025, 6e-7, 0.01])
    for cost, truth in ((target, t_true), (speculator, s_true)):
        for m, c, calls in [(128, 0, 1), (1, 128, 1), (1024, 0, 2), (1, 1024, 1), (4096, 0, 8), (1, 4096, 1)]:
            cost.observe(m, c, calls, float(features(m, c, calls) @ truth))
    costs = Costs(target=target, speculator=speculator)
    costs.kept_ratios[ContentKind.PROSE] = 0.07
    long = plan(work(8000, lookahead=1, n_batch=512), PrefillPolicy(), CLEAR, costs)
    assert long.status is Status.ACTIVE, long.reason
    est = estimate(work(8000, lookahead=1, n_batch=512), costs)
    assert est.dense_s == pytest.approx(float(features(8000, 0, 16) @ t_true), rel=0.1)
    short = plan(work(1100, lookahead=1, n_batch=512), PrefillPolicy(), CLEAR,
                 Costs(target=target, speculator=linear(0.006)))
    assert short.status is Status.SKIPPED_BREAK_EVEN  # a speculator as dear as the target never pays


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
    assert not kept & set(range(412, 3374)) and not kept & set(range(3452, 5414))  # result bodies are free
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


def test_one_contended_measurement_does_not_teach_the_planner_that_scoring_is_dear():
    truth = np.array([0.004, 3e-7, 0.01])
    clean, dirty = PrefillCost(), PrefillCost()
    shapes = [(128, 0, 1), (1, 128, 1), (1300, 0, 3), (1, 1300, 1), (4300, 0, 9), (1, 4300, 1), (1, 8000, 1)]
    for m, c, calls in shapes:
        for cost in (clean, dirty):
            cost.observe(m, c, calls, float(features(m, c, calls) @ truth))
    dirty.observe(2300, 0, 5, 3 * float(features(2300, 0, 5) @ truth))  # shared the cores with a build
    dirty.observe(1, 2300, 1, 6 * float(features(1, 2300, 1) @ truth))
    assert dirty.seconds(8000, 0, 16) == pytest.approx(clean.seconds(8000, 0, 16), rel=0.02)  # plain LSQ: 7.6% off


# -- the speculator mirroring the target (core.kv.positions.plan_speculator_sync) ----------

def sparse_session(n_history: int, kept_every: int) -> tuple[TokenCells, TokenCells]:
    """A session after one active turn: the speculator holds all ``n_history`` tokens, the
    target every ``kept_every``-th one and the last 10 (the reply)."""
    tokens = list(range(n_history))
    spec, target = TokenCells(), TokenCells()
    spec.extend(tokens, range(n_history))
    target.extend(tokens, [i if i % kept_every == 0 or i >= n_history - 10 else -1 for i in tokens])
    return spec, target


def calls(m: int) -> int:
    return max(1, -(-m // 512))


ATTENTION = PrefillCost(coef=np.array([0.007, 1.5e-6, 0.0]))  # this machine's speculator, roughly


def test_mirror_when_the_delta_would_attend_to_many_dropped_cells():
    spec, target = sparse_session(3700, 8)
    tokens = list(range(3700)) + [9] * 3500
    sync = plan_speculator_sync(spec, target, tokens, ATTENTION.seconds, calls)
    held = [i for i in range(3700) if i % 8 == 0 or i >= 3690]
    assert sync.rebuild == tuple(held) and sync.start == 3700 and sync.cells == len(held)
    # the estimate then charges the re-prefill of those cells, not the 3,700 dense ones
    w = Work(n_select=3500, n_protected=0, target_cached=len(held), n_score=3501, speculator_cached=sync.cells,
             lookahead=1, n_batch=512, compact=False, n_rebuild=sync.n_rebuild, rebuild_runs=2)
    stay = replace(w, speculator_cached=3700, n_rebuild=0, rebuild_runs=0)
    costs = Costs(target=ATTENTION, speculator=ATTENTION, speculator_step=linear(0.01))
    assert estimate(w, costs).scoring_s < estimate(stay, costs).scoring_s


def test_no_mirror_for_a_short_delta_or_a_dense_target_or_without_measurements():
    spec, target = sparse_session(3700, 8)
    short = plan_speculator_sync(spec, target, list(range(3700)) + [9] * 20, ATTENTION.seconds, calls)
    assert short.rebuild is None and short.start == 3700 and short.cells == 3700  # re-prefill dearer
    dense_spec, dense_target = sparse_session(3700, 1)
    dense = plan_speculator_sync(dense_spec, dense_target, list(range(3700)) + [9] * 3500, ATTENTION.seconds, calls)
    assert dense.rebuild is None
    fresh = plan_speculator_sync(spec, target, list(range(3700)) + [9] * 3500, PrefillCost().seconds, calls)
    assert fresh.rebuild is None


def test_mirror_keeps_the_last_history_token_and_only_the_shared_prefix():
    spec, target = sparse_session(3700, 8)
    tokens = list(range(3000)) + [9] * 4000  # diverges inside the history
    sync = plan_speculator_sync(spec, target, tokens, ATTENTION.seconds, calls)
    assert sync.rebuild is not None and sync.start == 3000
    assert 2999 not in cached_indices(target, 3000)  # dropped by the target, yet re-prefilled:
    assert sync.rebuild[-1] == 2999 and all(i < 3000 for i in sync.rebuild)  # positions stay logical after it


def test_a_window_bounds_what_each_token_attends_to():
    assert attended(10, 5) == sum(5 + i for i in range(10))
    assert attended(10, 5, span=100) == attended(10, 5)  # the window never binds
    assert attended(10, 5, span=8) == sum(min(5 + i, 8) for i in range(10))
    assert attended(10, 50, span=8) == 10 * 8  # every token at the window already
    cost = PrefillCost(coef=np.array([0.01, 1e-5, 0.0]))
    full, windowed = cost.seconds(8000, 0, 16), cost.seconds(8000, 0, 16, span=2600)
    assert windowed < full and windowed == pytest.approx(0.01 * 8000 + 1e-5 * attended(8000, 0, 2600))


def test_a_delta_the_guard_keeps_whole_is_not_scored():
    """The depth bench's first turn: a second system message and the user's task, all guarded.
    Scoring it cost 10.6 s and kept every token (0.81x dense)."""
    verdict = GuardVerdict(True, "request defines tools", ((0, 2150),), "system prompt and tool definitions")
    p = plan(work(2150, protected=2150), PrefillPolicy(min_tokens=0), verdict, SPEEDS)
    assert p.status is Status.SKIPPED_BREAK_EVEN and not p.score and "nothing to drop" in p.reason
    # uncalibrated too: there is nothing a measurement could change
    assert not plan(work(2150, protected=2150), PrefillPolicy(min_tokens=0), verdict, Costs()).score
    # one free token is enough to let the cost model decide; break-even off always scores
    assert plan(work(2150, protected=2149), PrefillPolicy(min_tokens=0), verdict, Costs()).score
    assert plan(work(2150, protected=2150), PrefillPolicy(min_tokens=0, break_even=False), verdict, SPEEDS).score


def test_keeping_everything_costs_the_dense_prefill_not_runs_and_bridges():
    costs = Costs(target=PrefillCost(coef=np.array([0.025, 1e-6, 3.0])), speculator=linear(0.01),
                  speculator_step=linear(0.01), run_tokens=4096.0)  # one run: fewer calls than dense
    est = estimate(work(2150, protected=2150), costs)
    assert est.kept == 2150 and est.sparse_s == est.dense_s and est.saved_s == 0
