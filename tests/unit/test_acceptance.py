"""Speculative acceptance rules and SpecAttn's view selection, without a model."""

from __future__ import annotations

import numpy as np
import pytest

from core.decoding.acceptance import accept_greedy, accept_stochastic, distribution, sample
from core.decoding.specattn import SparseVerify, layer_weights, proportional_map, select_cells, view_spans
from core.policies import SamplingParams


def softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max())
    return e / e.sum()


def test_distribution_applies_temperature_top_k_and_top_p():
    z = np.array([3.0, 2.0, 1.0, 0.0, -1.0])
    np.testing.assert_allclose(distribution(z, SamplingParams(temperature=0.5)), softmax(z / 0.5))
    top2 = distribution(z, SamplingParams(temperature=1.0, top_k=2))
    np.testing.assert_allclose(top2, np.r_[softmax(z[:2]), 0, 0, 0])
    # top-p at temperature 1: softmax(z) = .64 .24 .09 ...: 0.8 needs the first two tokens
    nucleus = distribution(z, SamplingParams(temperature=2.0, top_p=0.8))
    assert (nucleus > 0).tolist() == [True, True, False, False, False]
    np.testing.assert_allclose(nucleus[:2], softmax(z[:2] / 2.0))


def test_accept_greedy_takes_the_longest_matching_prefix():
    rows = [np.eye(6)[t] for t in (1, 2, 3, 4)]  # the target wants 1 2 3 then 4
    assert accept_greedy(rows, [1, 2, 3]) == (3, 4)  # all accepted + bonus
    assert accept_greedy(rows, [1, 5, 3]) == (1, 2)  # stops at the first mismatch, target's token
    assert accept_greedy(rows[:1], []) == (0, 1)


def test_rejection_sampling_reproduces_the_target_distribution():
    rng = np.random.default_rng(7)
    v = 6
    p = [softmax(rng.normal(size=v) * 2) for _ in range(3)]
    q = [softmax(rng.normal(size=v) * 2) for _ in range(2)]
    first = np.zeros(v)
    second = np.zeros(v)
    n = 40000
    for _ in range(n):
        drafts = [sample(q[0], rng), sample(q[1], rng)]
        k, nxt = accept_stochastic(p, q, drafts, rng)
        emitted = drafts[:k] + [nxt]
        first[emitted[0]] += 1
        if k >= 1:  # given d1 was accepted, the next token must follow p[1]
            second[emitted[1]] += 1
    assert 0.5 * np.abs(first / n - p[0]).sum() < 0.015
    assert 0.5 * np.abs(second / second.sum() - p[1]).sum() < 0.025


def test_rejection_sampling_accepts_everything_when_draft_equals_target():
    rng = np.random.default_rng(0)
    p = [softmax(rng.normal(size=8)) for _ in range(4)]
    for _ in range(200):
        drafts = [sample(p[i], rng) for i in range(3)]
        assert accept_stochastic(p, p[:3], drafts, rng)[0] == 3


def test_select_cells_keeps_sinks_last_and_the_union_of_steps():
    n_layer, n_head, n = 3, 2, 40
    step_a = np.full((n_layer, n_head, n + 1), 1e-4)
    step_a[..., 10] = 1.0  # step a looks at key 10
    step_b = np.full((n_layer, n_head, n + 2), 1e-4)
    step_b[..., 20] = 1.0  # step b at key 20 (and has keys beyond n: ignored)
    mask = select_cells([step_a, step_b], np.ones(n_layer), p=0.9, n_cells=n, keep_first=4)
    assert np.flatnonzero(mask).tolist() == [0, 1, 2, 3, 10, 20, 39]


def test_select_cells_weights_follow_the_layer_map():
    step = np.full((2, 1, 30), 1e-4)
    step[0, 0, 5] = 1.0  # draft layer 0 looks at 5, layer 1 at 25
    step[1, 0, 25] = 1.0
    only_layer_1 = layer_weights(np.array([1, 1, 1]), 2)
    mask = select_cells([step], only_layer_1, p=0.9, n_cells=30, keep_first=0)
    assert np.flatnonzero(mask).tolist() == [25, 29]


def test_view_spans_map_logical_tokens_to_target_positions():
    # logical tokens 0..9; tokens 3-5 were dropped by a sparse prefill (original positions)
    positions = [0, 1, 2, -1, -1, -1, 6, 7, 8, 9]
    step = np.full((1, 1, 11), 1e-6)
    step[0, 0, 4] = 1.0  # the draft wants a dropped token: nothing to attend to there
    step[0, 0, 7] = 1.0
    spans, n = view_spans(SparseVerify(np.ones(1), p=0.9, keep_first=1), [step], positions, tpos=10)
    assert spans == [(0, 1), (7, 8), (9, 10)] and n == 3


def test_proportional_map_spans_both_ends():
    m = proportional_map(28, 24)
    assert m[0] == 0 and m[-1] == 23 and np.all(np.diff(m) >= 0)
    with pytest.raises(ValueError):
        select_cells([np.ones((1, 1, 4))], np.ones(1), p=0.0, n_cells=4)
