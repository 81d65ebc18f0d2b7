"""SpecAttn's pure parts against references: bisection top-p vs a sort, the DP layer map vs brute force."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from core.decoding.specattn import (
    kl_similarity,
    monotone_layer_map,
    top_p_mask,
    top_p_mask_sorted,
    top_p_threshold,
)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.95, 0.99])
def test_bisection_mass_and_size_against_sorted_reference(p):
    rng = np.random.default_rng(0)
    attn = rng.dirichlet(np.full(300, 0.3), size=64)
    mask = top_p_mask(attn, p)
    ref = top_p_mask_sorted(attn, p)
    kept_mass = (attn * mask).sum(axis=1)
    assert (kept_mass >= p - 1e-9).all()
    # 10 rounds resolve the threshold to max/1024: at most a few extra cells
    extra = mask.sum(axis=1) - ref.sum(axis=1)
    assert (extra >= 0).all() and extra.max() <= 0.1 * attn.shape[1]
    assert (mask | ~ref).all()  # every reference cell is selected too


def test_ties_and_all_equal_rows():
    equal = np.full((2, 10), 0.1)
    assert top_p_mask(equal, 0.5).all()  # ties are all-or-nothing: all kept
    assert top_p_mask_sorted(equal, 0.5).all()
    ties = np.array([[0.4, 0.2, 0.2, 0.2, 0.0]])
    assert top_p_mask(ties, 0.7).tolist() == [[True, True, True, True, False]]
    one_hot = np.array([[0.0, 1.0, 0.0]])
    assert top_p_mask(one_hot, 0.99).tolist() == [[False, True, False]]
    with pytest.raises(ValueError):
        top_p_threshold(equal, 0.0)


def test_more_rounds_tighten_the_set():
    rng = np.random.default_rng(1)
    attn = rng.dirichlet(np.full(1000, 0.2), size=8)
    coarse = top_p_mask(attn, 0.95, rounds=3).sum()
    fine = top_p_mask(attn, 0.95, rounds=20).sum()
    assert fine <= coarse and fine >= top_p_mask_sorted(attn, 0.95).sum()


def test_kl_similarity_is_zero_on_identical_layers_and_negative_elsewhere():
    rng = np.random.default_rng(2)
    layers = rng.dirichlet(np.ones(50), size=3)
    s = kl_similarity(layers, layers)
    assert np.allclose(np.diag(s), 0.0, atol=1e-6)
    assert (s[~np.eye(3, dtype=bool)] < 0).all()


def test_monotone_map_matches_brute_force():
    rng = np.random.default_rng(3)
    for _ in range(20):
        sim = rng.normal(size=(4, 5))
        best = max((m for m in itertools.product(range(4), repeat=5) if list(m) == sorted(m)),
                   key=lambda m: sum(sim[i, j] for j, i in enumerate(m)))
        got = monotone_layer_map(sim)
        assert list(got) == sorted(got)
        assert np.isclose(sum(sim[i, j] for j, i in enumerate(got)), sum(sim[i, j] for j, i in enumerate(best)))


def test_log_bisection_resolves_long_rows_with_an_attention_sink():
    """A real draft row at 4K: a sink holds half the mass, the rest is spread thin.
    Linear bisection (max/1024 resolution) keeps every cell; log bisection does not."""
    rng = np.random.default_rng(3)
    n = 4096
    rest = rng.dirichlet(np.full(n - 1, 0.5)) * 0.5
    row = np.concatenate([[0.5], rest])[None, :]
    ref = top_p_mask_sorted(row, 0.95)
    linear = top_p_mask(row, 0.95, scale="linear")
    log = top_p_mask(row, 0.95)
    assert linear.all()
    assert (row * log).sum() >= 0.95 - 1e-9 and (log | ~ref).all()
    assert log.sum() <= 1.1 * ref.sum() < 0.8 * n
    with pytest.raises(ValueError):
        top_p_mask(row, 0.95, scale="cubic")
