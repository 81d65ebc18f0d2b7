import numpy as np
import pytest

from core.specprefill.scoring import boost, importance, mean_pool, normalize, reduce_steps


def test_reduce_steps_max_heads_then_layers_then_mean_steps():
    # 2 layers, 2 heads, 3 tokens; step 2 sees one extra key (its lookahead token)
    s1 = np.array([[[0.1, 0.5, 0.2], [0.3, 0.1, 0.0]],
                   [[0.0, 0.2, 0.9], [0.4, 0.0, 0.1]]], dtype=np.float32)
    s2 = np.zeros((2, 2, 4), dtype=np.float32)
    s2[1, 0, :] = [0.2, 0.2, 0.1, 0.9]
    out = reduce_steps([s1, s2], 3)
    # step1: max heads -> L0 [0.3,0.5,0.2], L1 [0.4,0.2,0.9]; max layers -> [0.4,0.5,0.9]
    # step2: [0.2,0.2,0.1] (the 4th key is a lookahead token, not scored)
    np.testing.assert_allclose(out, [0.3, 0.35, 0.5], rtol=1e-6)


def test_reduce_steps_rejects_short_rows():
    with pytest.raises(ValueError):
        reduce_steps([np.zeros((1, 1, 2), dtype=np.float32)], 3)


def test_reduce_steps_without_capture_is_uniform():
    np.testing.assert_array_equal(reduce_steps([], 4), np.ones(4))


def test_mean_pool_centered_with_partial_edges():
    x = np.array([0, 0, 3, 0, 0], dtype=np.float32)
    np.testing.assert_allclose(mean_pool(x, 3), [0, 1, 1, 1, 0])
    np.testing.assert_allclose(mean_pool(np.array([3.0, 0.0]), 3), [1.5, 1.5])
    np.testing.assert_array_equal(mean_pool(x, 1), x)


def test_normalize_min_max_and_constant():
    np.testing.assert_allclose(normalize(np.array([2.0, 4.0, 3.0])), [0, 1, 0.5])
    np.testing.assert_array_equal(normalize(np.array([5.0, 5.0])), [1, 1])


def test_boost_first_and_last():
    out = boost(np.ones(10, dtype=np.float32), 2, 1.5, 3, 1.3)
    np.testing.assert_allclose(out, [1.5, 1.5, 1, 1, 1, 1, 1, 1.3, 1.3, 1.3])


def test_importance_pipeline_order():
    step = np.zeros((1, 1, 6), dtype=np.float32)
    step[0, 0] = [1, 2, 3, 4, 5, 6]
    out = importance([step], 6, pool_kernel=0, first_n=1, first_mult=2.0, last_n=1, last_mult=3.0)
    # normalized [0, .2, .4, .6, .8, 1] then boosted
    np.testing.assert_allclose(out, [0, 0.2, 0.4, 0.6, 0.8, 3.0], atol=1e-6)


def test_filter_layer_aggregations_read_only_the_last_layer():
    step = np.zeros((3, 2, 4), dtype=np.float32)
    step[0, 0, 0] = 9.0  # an early layer's peak: only the guide's max-max sees it
    step[2, 0, 1], step[2, 1, 1] = 0.3, 0.3
    step[2, 0, 2] = 0.5
    assert int(np.argmax(reduce_steps([step], 4, "max"))) == 0
    assert reduce_steps([step], 4, "filter-sum").tolist() == pytest.approx([0.0, 0.6, 0.5, 0.0])
    assert reduce_steps([step], 4, "filter-max").tolist() == pytest.approx([0.0, 0.3, 0.5, 0.0])
    with pytest.raises(ValueError, match="aggregation"):
        reduce_steps([step], 4, "mean")
