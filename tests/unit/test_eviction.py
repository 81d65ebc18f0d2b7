"""Scored eviction past the window, without a model: which tokens a session gives up
(core.kv.eviction), the position bookkeeping of packed cells (core.kv.positions), and the
scorer's forced rebuild when staying would pass its window."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import PromptTooLong
from core.kv.eviction import CHUNK, USER_HEAD, USER_TAIL, USER_WHOLE, choose, plan_fit, protected
from core.kv.positions import SessionKV, TokenCells, plan_speculator_sync, speculator_backlog
from core.prompt import Prompt, Span
from core.spans import runs_of_equal

NAN = float("nan")


def agent_prompt(n_tool: int, tools: int = 3) -> Prompt:
    """system (100), then ``tools`` rounds of user (20), assistant call (10), tool result
    (``n_tool``), and a last user message (20)."""
    spans, at = [Span("system", 0, 100)], 100
    for _ in range(tools):
        spans += [Span("user", at, at + 20), Span("assistant", at + 20, at + 30, tool_calls=True),
                  Span("tool", at + 30, at + 30 + n_tool)]
        at += 30 + n_tool
    spans.append(Span("user", at, at + 20))
    return Prompt(tuple(range(at + 20)), tuple(spans), has_tools=True)


def test_choose_drops_the_lowest_scored_chunks_first_then_unscored_oldest_first():
    n = 8 * CHUNK
    scores = np.full(n, NAN, dtype=np.float32)
    scores[: 4 * CHUNK] = np.repeat([0.9, 0.1, 0.5, 0.2], CHUNK)  # chunks 0-3 scored, 4-7 not
    every = np.ones(n, dtype=bool)
    one = choose(every, scores, 1)
    assert one.tolist() == list(range(CHUNK, 2 * CHUNK))  # a whole chunk, the lowest scored
    three = choose(every, scores, 2 * CHUNK + 1)
    assert sorted(set((three // CHUNK).tolist())) == [1, 2, 3]  # 0.1, 0.2, then 0.5
    six = choose(every, scores, 5 * CHUNK + 1)
    assert sorted(set((six // CHUNK).tolist())) == [0, 1, 2, 3, 4, 5]  # then unscored, oldest first
    assert choose(every, scores, 0).size == 0


def test_choose_takes_only_candidates_and_stops_when_they_run_out():
    n = 4 * CHUNK
    candidates = np.zeros(n, dtype=bool)
    candidates[CHUNK + 5: CHUNK + 9] = True
    drop = choose(candidates, np.zeros(n, dtype=np.float32), 100)
    assert drop.tolist() == list(range(CHUNK + 5, CHUNK + 9))


def test_protected_keeps_instructions_calls_the_last_message_edges_and_the_recent_tail():
    p = agent_prompt(200)
    keep = protected(len(p), p.spans, recent=50)
    for s in p.spans:
        if s.role in ("system", "user") or s.tool_calls:
            assert keep[s.start:s.end].all(), s
    tool = p.spans[3]
    inner = keep[tool.start:tool.end]
    assert inner[:6].all() and inner[-3:].all() and not inner[6:-3].any()  # the template tokens stay
    assert keep[-50:].all()
    assert protected(10, (), 0).all()  # a raw prompt: nothing is known to be a tool result


def test_a_long_user_message_keeps_its_ends_and_gives_up_its_middle_by_score():
    """An attached file (Claude Code's @file, its re-attached reads after a compaction) sits in
    a user message: only its two ends, where the words typed go, always stay."""
    long_user = USER_WHOLE + 1000
    spans = (Span("system", 0, 100), Span("user", 100, 100 + long_user), Span("user", 100 + long_user, 612 + long_user))
    n = spans[-1].end
    keep = protected(n, spans, recent=0)
    first = keep[100:100 + long_user]
    assert first[:USER_HEAD].all() and first[-USER_TAIL:].all()
    assert not first[USER_HEAD:-USER_TAIL].any()
    assert keep[:100].all() and keep[100 + long_user:].all()  # the system prompt; a user message of USER_WHOLE
    latest = protected(100 + long_user, spans[:2], recent=0)
    assert latest.all()  # the last user message is the request: it stays whole, however long
    scores = np.ones(n, dtype=np.float32)
    scores[600:700] = 0.0  # the attached file's least important lines
    fit = plan_fit(Prompt(tuple(range(n)), spans), TokenCells(list(range(n)), list(range(n))), scores,
                   window=n - 50, reply=0, recent=0)
    assert fit is not None and not fit.keep[600:700].any() and fit.keep[:100 + USER_HEAD].all()


def test_plan_fit_is_none_while_the_turn_fits():
    p = agent_prompt(200)
    assert plan_fit(p, TokenCells(), np.full(len(p), NAN), window=len(p) + 64, reply=64, recent=0) is None


def test_plan_fit_with_no_cache_drops_the_oldest_tool_results_and_prefills_the_rest_first():
    p = agent_prompt(400)  # 100 + 3 * 430 + 20 = 1410 tokens
    window = 1000
    fit = plan_fit(p, TokenCells(), np.full(len(p), NAN), window=window, reply=100, recent=0)
    assert fit is not None
    kept_through = int(fit.keep.sum()) + (len(p) - fit.through)
    assert window - CHUNK < kept_through + 100 <= window  # unscored new tokens: only what must go
    dropped = np.flatnonzero(~fit.keep)
    assert dropped.size == fit.dropped
    first_tool = p.spans[3]
    assert first_tool.start + 6 <= dropped[0] < first_tool.end  # the oldest tool result goes first
    assert not np.isin(dropped, np.arange(0, 100)).any()  # never the system prompt
    assert fit.through == dropped[-1] + 2 < p.spans[-1].start and fit.keep[-1]


def test_new_tokens_go_only_as_far_as_the_turn_must_while_cached_ones_go_to_a_quarter_free():
    p = agent_prompt(400, tools=2)  # 100 + 2 * 430 + 20 = 980 tokens
    q = p.spans[6].start + 100  # the second tool result arrives: 300 of its tokens and the last message are new
    target = TokenCells(list(p.tokens[:q]), list(range(q)))
    scores = np.full(len(p), NAN, dtype=np.float32)
    scores[:q] = 1.0
    window, reply = 430, 50
    fit = plan_fit(p, target, scores, window=window, reply=reply, recent=0)
    assert fit is not None
    dropped = np.flatnonzero(~fit.keep)
    old, new = dropped[dropped < q], dropped[dropped >= q]
    assert old.size and new.size  # the cached tool result could not free enough alone
    least = len(p) + reply - window
    assert least <= dropped.size < least + CHUNK  # new tokens: no more than the turn needs
    cached_free = (p.spans[3].end - p.spans[3].start - 9) + (100 - 6)  # both results' droppable cached tokens
    assert old.size == cached_free  # every cached candidate went first


def test_plan_fit_drops_the_lowest_scored_cached_tokens_and_keeps_the_recent_ones():
    p = agent_prompt(400)
    n = len(p)
    q = n - 20  # the history is cached; the last user message is new
    target = TokenCells(list(p.tokens[:q]), list(range(q)))
    scores = np.full(n, NAN, dtype=np.float32)
    scores[:q] = 1.0
    late_tool = p.spans[9]
    scores[late_tool.start + 64: late_tool.start + 192] = 0.0  # the latest result's middle scored lowest
    fit = plan_fit(p, target, scores, window=1300, reply=50, recent=0)
    assert fit is not None and fit.through == q
    dropped = np.flatnonzero(~fit.keep)
    assert set(range(late_tool.start + 64, late_tool.start + 192)) <= set(dropped.tolist())
    with_recent = plan_fit(p, target, scores, window=1300, reply=50, recent=500)
    assert with_recent is not None
    assert not (np.flatnonzero(~with_recent.keep) >= n - 500).any()


def test_plan_fit_refuses_when_what_must_stay_does_not_fit():
    p = agent_prompt(400)
    with pytest.raises(PromptTooLong):
        plan_fit(p, TokenCells(), np.full(len(p), NAN), window=200, reply=50, recent=0)


def test_packed_positions_and_where_the_next_token_goes():
    sparse = TokenCells(list(range(6)), [0, -1, 2, 3, -1, -1])  # original mode: gaps, trailing drop
    assert sparse.packed == 0 and sparse.end_pos == 6
    packed = TokenCells(list(range(6)), [0, -1, 1, 2, -1, -1])
    assert packed.packed == 1 and packed.end_pos == 5 and packed.next_pos == 3
    assert TokenCells().end_pos == 0
    assert packed.next_pos_at(2) == 1 and packed.next_pos_at(1) == 1 and packed.next_pos_at(0) == 0


def test_a_sparse_prefill_is_recorded_packed_or_at_its_logical_positions():
    kept = np.array([0, 2, 3])
    compact, original = TokenCells([9], [0]), TokenCells([9], [0])
    compact.extend_kept([5, 6, 7, 8], kept, 1, compact=True)
    original.extend_kept([5, 6, 7, 8], kept, 1, compact=False)
    assert compact.kv_pos == [0, 1, -1, 2, 3] and compact.next_pos == 4
    assert original.kv_pos == [0, 1, -1, 3, 4] and original.next_pos == 5


def test_scores_are_kept_only_over_the_tokens_they_scored():
    kv = SessionKV()
    kv.scores = np.arange(5, dtype=np.float32)
    got = kv.scores_over(7, valid=3)
    assert got[:3].tolist() == [0, 1, 2] and np.isnan(got[3:]).all()
    kv.reset()
    assert kv.scores.size == 0


def test_a_scorer_past_its_window_is_rebuilt_as_the_packed_targets_mirror():
    tokens = list(range(100))
    spec = TokenCells(tokens[:90], list(range(90)))  # dense, as a scorer is
    target = TokenCells(tokens[:90], [i // 2 if i % 2 == 0 else -1 for i in range(90)])  # packed, half kept
    target.kv_pos[89] = 45
    cheap = lambda n, cells, calls: 0.0 if n < 50 else 1.0  # noqa: E731 -- staying is cheaper
    stay = plan_speculator_sync(spec, target, tokens, cheap, lambda n: 1)
    assert stay.rebuild is None
    forced = plan_speculator_sync(spec, target, tokens, cheap, lambda n: 1, limit=64)
    assert forced.rebuild is not None and forced.packed and forced.start == 90
    assert speculator_backlog(SessionKV(target, TokenCells()), 1000) == (0, [])  # no dense catch-up


def test_runs_of_equal_values():
    assert runs_of_equal(np.array([0, 0, -1, -1, -1, -3])) == [(0, 2), (2, 5), (5, 6)]
    assert runs_of_equal(np.array([], dtype=np.int64)) == []


def test_the_logical_limit_is_four_windows_unless_set():
    from core.config import EngineConfig
    from core.errors import ConfigError

    assert EngineConfig(n_ctx=1000).context_limit == 4000
    assert EngineConfig(n_ctx=1000, speculator_n_ctx=800).context_limit == 3200
    assert EngineConfig(n_ctx=1000, max_context_tokens=5000).context_limit == 5000
    with pytest.raises(ConfigError, match="max_context_tokens"):
        EngineConfig(n_ctx=1000, max_context_tokens=-1)
    with pytest.raises(ConfigError, match="evict_order"):
        from core.policies import PrefillPolicy

        PrefillPolicy(evict_order="newest")
