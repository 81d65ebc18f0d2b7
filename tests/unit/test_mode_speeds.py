import numpy as np
import pytest

from core.decoding.mode_speeds import MIN_TOKENS, ModeSpeeds, fit
from core.policies import DecodeMode

PLAIN, SPEC, ATTN = DecodeMode.PLAIN, DecodeMode.SPECULATIVE, DecodeMode.SPECATTN


def test_nothing_measured_or_only_plain_measured_is_plain():
    s = ModeSpeeds()
    assert s.pick(16_000, [SPEC, ATTN]) is PLAIN
    s.observe(SPEC, 16_000, 64, 1.0)  # a fast speculative decode, but plain never measured: no comparison
    assert s.pick(16_000, [SPEC]) is PLAIN
    s.observe(PLAIN, 16_000, 64, 64 / 7.6)
    assert s.pick(16_000, [SPEC]) is SPEC
    assert s.pick(16_000, []) is PLAIN  # a mode this server cannot run is never picked


def test_the_fit_recovers_weights_and_attention_per_token():
    depths = np.array([1_000, 4_000, 8_000, 16_000], dtype=np.float64)
    a, b = fit(np.stack([depths, 0.05 + 6e-6 * depths], axis=1))
    assert a == pytest.approx(0.05) and b == pytest.approx(6e-6)
    assert fit(np.array([[4_000, 0.1], [4_000, 0.3]])) == (pytest.approx(0.2), 0.0)  # one depth: flat


def test_the_pick_follows_depth_where_the_measured_lines_cross():
    """Plain: cheap steps that grow with depth; SpecAttn: dearer at first, but its sparse
    verify makes depth cost less (the shape results/specattn.md measured for the verify)."""
    s = ModeSpeeds()
    for depth in (2_000, 8_000, 16_000, 24_000):
        s.observe(PLAIN, depth, 32, 32 * (0.04 + 8e-6 * depth))
        s.observe(ATTN, depth, 32, 32 * (0.09 + 2e-6 * depth))
    assert s.pick(4_000, [SPEC, ATTN]) is PLAIN  # 0.072 vs 0.098 s/token
    assert s.pick(16_000, [SPEC, ATTN]) is ATTN  # 0.168 vs 0.122


def test_short_replies_are_not_measurements():
    s = ModeSpeeds()
    s.observe(PLAIN, 8_000, MIN_TOKENS - 1, 0.1)
    s.observe(PLAIN, 8_000, 10, 0.0)
    assert s.seconds_per_token(PLAIN, 8_000) is None


def test_a_copy_turn_tries_lookup_until_measured_and_free_turns_stay_plain():
    from core.decoding.mode_speeds import COPY, FREE

    LOOKUP = DecodeMode.LOOKUP
    s = ModeSpeeds()
    assert s.pick(8_000, [LOOKUP], COPY) is LOOKUP  # never measured on copy turns: tried
    assert s.pick(8_000, [LOOKUP], FREE) is PLAIN
    assert s.pick(8_000, [SPEC], COPY) is PLAIN  # lookup not offered
    s.observe(LOOKUP, 8_000, 64, 64 / 30.0, COPY)  # copying at 30 tok/s
    s.observe(PLAIN, 8_000, 64, 64 / 10.0, COPY)
    s.observe(LOOKUP, 8_000, 64, 64 / 9.0, FREE)  # prose: a little slower than plain
    s.observe(PLAIN, 8_000, 64, 64 / 10.0, FREE)
    assert s.pick(8_000, [LOOKUP, SPEC], COPY) is LOOKUP and s.pick(8_000, [LOOKUP, SPEC], FREE) is PLAIN
