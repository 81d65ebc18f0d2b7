"""The step loop's chunk budget without models: a chunk costs at most its share of the step."""

from __future__ import annotations

import pytest

from core.runtime.chunk_budget import ALPHA, ChunkBudget


def linear(per_token: float, per_cell: float = 0.0, per_call: float = 0.0):
    """A cost function shaped like core.specprefill.cost_model's: weights plus attention over ``pos`` cells,
    plus one call's overhead."""
    return lambda ctx, n, pos: n * (per_token + per_cell * pos) + per_call


def test_cap_zero_is_decode_first_and_no_share_is_a_fixed_chunk():
    assert ChunkBudget(0, 0.5, linear(0.01)).tokens("ctx", 0) == 0
    assert ChunkBudget(16).tokens("ctx", 0) == 16
    assert ChunkBudget(16, 0.0, linear(0.01)).tokens("ctx", 0) == 16
    assert ChunkBudget(16, 0.5, None).tokens("ctx", 0) == 16


def test_the_first_streaming_step_carries_no_chunk_and_measures_the_streams_alone():
    budget = ChunkBudget(256, 0.5, linear(0.01))
    assert budget.tokens("ctx", 0) == 0
    budget.observe(0.2, 0.0)
    assert budget.base_s == pytest.approx(0.2)
    assert budget.tokens("ctx", 0) == 10  # 0.5 * 0.2 s / 0.01 s a token


def test_a_chunk_is_at_least_one_token_and_at_most_the_cap():
    budget = ChunkBudget(64, 0.5, linear(1.0), base_s=0.1)
    assert budget.tokens("ctx", 0) == 1  # dearer than the budget: still moves
    budget = ChunkBudget(64, 0.5, linear(1e-6), base_s=0.1)
    assert budget.tokens("ctx", 0) == 64


def test_deeper_in_a_long_prompt_the_chunk_shrinks():
    budget = ChunkBudget(256, 1.0, linear(0.01, 0.01 / 4096), base_s=0.4)
    assert budget.tokens("ctx", 0) == 40
    assert budget.tokens("ctx", 8192) == 13  # attention over 8K cells triples a token's cost


def test_the_chunks_own_call_comes_out_of_the_budget_first():
    budget = ChunkBudget(256, 0.5, linear(2 ** -6, per_call=2 ** -4), base_s=0.25)
    assert budget.tokens("ctx", 0) == 4  # (0.125 s - 0.0625 s) / 0.015625 s
    assert ChunkBudget(256, 0.5, linear(0.01, per_call=0.2), base_s=0.2).tokens("ctx", 0) == 1


def test_the_budget_learns_the_step_cost_without_its_chunk():
    budget = ChunkBudget(256, 0.5, linear(0.01), base_s=0.2)
    assert budget.chunk_s("ctx", 10, 0) == pytest.approx(0.1)
    budget.observe(0.5, budget.chunk_s("ctx", 10, 0))  # the streams cost 0.4 s this step
    assert budget.base_s == pytest.approx(0.2 + ALPHA * (0.4 - 0.2))
    budget.observe(0.05, 0.1)  # a chunk faster than expected never makes the base negative
    assert budget.base_s >= 0


def test_an_uncalibrated_cost_falls_back_to_the_cap():
    assert ChunkBudget(32, 0.5, lambda ctx, n, pos: 0.0, base_s=0.1).tokens("ctx", 0) == 32
