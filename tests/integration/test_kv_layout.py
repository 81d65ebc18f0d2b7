"""What the KV layout may change and what it may not: with ``--kv-layout unified`` the target's
slots share one pool of cells, but the scorer keeps a stream per slot, because a captured
attention row maps its columns to tokens by the order of the sequence's own cells."""

from __future__ import annotations

import numpy as np
import pytest

from core.engine import Engine
from core.kv.positions import SessionKV
from core.results import Timings
from core.steps import drive
from tests.support import engine_config

TEXT = "Unit 7 reported a pressure alarm at noon; unit 3 stayed within limits all day. " * 12


@pytest.fixture(params=["split", "unified"])
def engine(request, tiny_target, tiny_speculator):
    e = Engine(engine_config(tiny_target, tiny_speculator, slots=2, kv_layout=request.param))
    yield e
    e.close()


def rows_after_another_slot(engine: Engine) -> np.ndarray:
    """Slot 1 holds other tokens first (in one pool they take the first cells); then slot 0's
    prompt is scored: the captured row of its last token, one column per token."""
    tokens = tuple(engine.target.tokenize(TEXT, add_special=False))
    engine.speculator_ctx.seq(1).decode(list(range(300, 400)), 0, logits_last=False)
    try:
        steps = drive(engine.spec.capture_steps(SessionKV(), tokens, 0, Timings(), slot=0))
    finally:
        engine.speculator_ctx.clear_cells()
    return steps[0]


def test_the_scorer_sees_the_same_attention_in_either_layout(tiny_target, tiny_speculator, engine):
    alone = Engine(engine_config(tiny_target, tiny_speculator, slots=1))
    try:
        tokens = tuple(alone.target.tokenize(TEXT, add_special=False))
        want = drive(alone.spec.capture_steps(SessionKV(), tokens, 0, Timings(), slot=0))[0]
    finally:
        alone.close()
    assert engine.speculator_ctx.private_cells  # a stream per slot, in either layout
    got = rows_after_another_slot(engine)
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-3


def test_the_target_shares_cells_only_in_one_pool(engine):
    unified = engine.config.kv_layout == "unified"
    assert engine.target_ctx.private_cells is not unified
    assert (engine.target_ctx.scratch_seq >= 0) is unified and engine.target_ctx.movable_labels
