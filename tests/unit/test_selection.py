from dataclasses import replace

import numpy as np

from core.policies import Selection
from core.spans import runs
from core.specprefill.selection import (
    cap_chunks,
    chunk_means,
    forced_mask,
    select_by_fraction,
    select_by_mass,
    select_tokens,
)


def test_chunk_means_partial_last_chunk():
    np.testing.assert_allclose(chunk_means(np.array([1, 3, 5, 7, 9.0]), 2), [2, 6, 9])


def test_mass_keeps_highest_until_threshold():
    scores = np.array([0.1, 0.5, 0.3, 0.1])
    np.testing.assert_array_equal(select_by_mass(scores, 0.5), [False, True, False, False])
    np.testing.assert_array_equal(select_by_mass(scores, 0.8), [False, True, True, False])
    np.testing.assert_array_equal(select_by_mass(scores, 0.85), [True, True, True, False])
    assert select_by_mass(scores, 1.0).all()


def test_mass_with_zero_total_keeps_all():
    assert select_by_mass(np.zeros(3), 0.85).all()


def test_fraction_keeps_ceil_and_breaks_ties_by_position():
    scores = np.array([0.2, 0.9, 0.2, 0.2, 0.5])
    np.testing.assert_array_equal(select_by_fraction(scores, 0.5), [True, True, False, False, True])
    np.testing.assert_array_equal(select_by_fraction(scores, 0.01), [False, True, False, False, False])


def test_forced_first_last_and_spans():
    m = forced_mask(10, 2, 1, [(4, 6)])
    np.testing.assert_array_equal(np.flatnonzero(m), [0, 1, 4, 5, 9])


def test_cap_drops_lowest_chunks_not_every_nth():
    means = np.array([0.9, 0.1, 0.5, 0.7])
    mask = np.ones(4, dtype=bool)
    forced = np.zeros(16, dtype=bool)
    out = cap_chunks(mask, means, 4, forced, 8)
    np.testing.assert_array_equal(out, [True, False, False, True])


def test_select_tokens_mass_mode_always_keeps_edges():
    scores = np.zeros(100, dtype=np.float32)
    scores[40:50] = 1.0
    kept = select_tokens(scores, Selection(chunk_size=10, mass=0.85, keep_first=4, keep_last=2))
    np.testing.assert_array_equal(kept, [0, 1, 2, 3, *range(40, 50), 98, 99])


def test_select_tokens_chunk_mode_and_max_keep():
    scores = np.linspace(0, 1, 64).astype(np.float32)
    half = Selection(chunk_size=8, select_mode="chunk", keep_fraction=0.5, keep_first=0, keep_last=1)
    kept = select_tokens(scores, half)
    np.testing.assert_array_equal(kept, np.arange(32, 64))
    capped = select_tokens(scores, replace(half, max_keep=16))
    np.testing.assert_array_equal(capped, np.arange(48, 64))


def test_protected_spans_survive_selection():
    scores = np.zeros(64, dtype=np.float32)
    scores[-8:] = 1
    kept = select_tokens(scores, Selection(chunk_size=8, mass=0.5, keep_first=0, keep_last=1), protected=[(10, 20)])
    assert set(range(10, 20)) <= set(kept.tolist())
    assert set(range(56, 64)) <= set(kept.tolist())
    assert 30 not in kept


def test_runs():
    assert runs(np.array([0, 1, 2, 5, 6, 9])) == [(0, 3), (5, 7), (9, 10)]
    assert runs(np.array([], dtype=np.int64)) == []


def test_bridge_gaps_fills_short_gaps_only():
    from core.spans import runs
    from core.specprefill.selection import bridge_gaps

    kept = np.array([0, 1, 2, 10, 11, 40, 41, 42, 44])
    bridged = bridge_gaps(kept, 8)
    assert runs(bridged) == [(0, 12), (40, 45)]  # gaps of 7 and 1 filled, the gap of 28 kept
    assert set(kept) <= set(bridged.tolist())
    assert bridge_gaps(kept, 0).tolist() == kept.tolist()
    assert bridge_gaps(kept, 100).tolist() == list(range(45))
    assert bridge_gaps(np.array([5]), 10).tolist() == [5]
