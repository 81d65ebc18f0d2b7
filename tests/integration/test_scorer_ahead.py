"""A long turn that runs densely brings its scorer along (``scorer_ahead_tokens``, issue 52):
an agent's first turn is kept whole by the tool guard, and its scorer would otherwise lag by
the whole prompt when the first tool turn comes, so that turn would run densely too."""

from __future__ import annotations

from core.chat import ChatTemplate
from core.kv.positions import SessionKV
from core.policies import SamplingParams
from tests.support import policy, with_sampling

DOC = " ".join(f"Entry {k}: valve {k % 6} pressure {k * 7 + 2} kPa." for k in range(90))


def test_a_long_dense_turn_prefills_its_scorer_too_and_the_next_turn_scores_only_its_own(tiny_engine):
    chat = ChatTemplate(tiny_engine.target)
    first = chat.render([{"role": "system", "content": DOC}, {"role": "user", "content": "Which valve?"}])
    lagging, ahead = SessionKV(), SessionKV()
    one = SamplingParams(max_tokens=1)
    for kv, tokens in ((lagging, 0), (ahead, 256)):
        tiny_engine.slot_cells.load(None)
        dense_first = policy(min_tokens=100_000, break_even=False, scorer_ahead_tokens=tokens)
        r = tiny_engine.run(first, with_sampling(dense_first, one), kv=kv)
        assert r.timings.specprefill == "skipped_min_tokens" and r.timings.prompt_n == len(first)
        if tokens:
            assert r.timings.speculator_prefill_n == len(first) - 1 and r.timings.scoring_ms > 0
        else:
            assert r.timings.speculator_prefill_n == 0
    assert len(lagging.speculator.tokens) == 0 and len(ahead.speculator.tokens) >= len(first) - 1
    # the next turn, scored: only its own tokens where the scorer came along
    reply = tiny_engine.target.detokenize(list(r.tokens))
    second = chat.render([{"role": "system", "content": DOC}, {"role": "user", "content": "Which valve?"},
                          {"role": "assistant", "content": reply}, {"role": "user", "content": "And unit 4?"}])
    tiny_engine.slot_cells.load(None)
    kv = SessionKV()
    tiny_engine.run(first, with_sampling(policy(min_tokens=100_000, scorer_ahead_tokens=256), one), kv=kv)
    scored = tiny_engine.run(second, with_sampling(policy(min_tokens=0, break_even=False), one), kv=kv)
    assert scored.timings.speculator_cache_n >= len(first) - 1
    assert scored.timings.speculator_prefill_n <= len(second) - len(first) + 8


def test_a_sibling_that_prefills_a_few_tokens_leaves_its_scorer_to_idle_time(tiny_engine):
    """The turn itself must prefill many tokens: a conversation that adopted its prefix (a few
    tokens to prefill, a scorer far behind) stays cheap."""
    chat = ChatTemplate(tiny_engine.target)
    prompt = chat.render([{"role": "system", "content": DOC}, {"role": "user", "content": "Which valve?"}])
    kv = SessionKV()
    tiny_engine.slot_cells.load(None)
    tiny_engine.run(prompt, with_sampling(policy(enabled=False), SamplingParams(max_tokens=1)), kv=kv)
    assert len(kv.speculator.tokens) == 0  # a dense turn with SpecPrefill off: no scorer
    follow = chat.render([{"role": "system", "content": DOC}, {"role": "user", "content": "Which valve? Quick."}])
    r = tiny_engine.run(follow, with_sampling(policy(min_tokens=100_000, scorer_ahead_tokens=256),
                                              SamplingParams(max_tokens=1)), kv=kv)
    assert r.timings.prompt_n < 256 and r.timings.speculator_prefill_n == 0
