"""Carry out a :class:`core.kv.eviction.Fit` on both models' cells of one slot.

The target drops what the fit leaves out and packs the rest (core.kv.packing); new tokens the
fit dropped too (a prompt longer than the window that arrives with little or no cache) are
never prefilled: the others before the last dropped one are prefilled now, packed after the
cache, and the turn's own prefill goes on from there.

The scoring model then holds the same tokens in the same order: it drops and packs the same
cells, and prefills what it lacked of the target's (a reply it had not caught up on, the new
tokens kept), so a later delta attends to what the target kept and its columns still map to
logical tokens.  That is the target's mirror (core.kv.positions.plan_speculator_sync) built
from what the scorer held, not from nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from core.kv import cells
from core.kv.eviction import Fit
from core.kv.packing import pack
from core.kv.positions import SessionKV, TokenCells
from core.kv.sparse_prefill import sparse_prefill
from core.llama.context import Seq
from core.spans import common_prefix
from core.steps import TurnSteps


def apply_fit(fit: Fit, tokens: Sequence[int], kv: SessionKV, target: Seq, scorer: Seq) -> TurnSteps[int]:
    """Fit the session to ``fit`` (its target record cut back to a common prefix with
    ``tokens``); returns the new tokens prefilled."""
    pack(target, kv.target, fit.keep)
    added = yield from _prefill_packed(target, kv.target, tokens, fit.keep, fit.through)
    spec = kv.speculator
    cells.rollback(scorer, spec, min(common_prefix(spec.tokens, tokens), fit.through))
    pack(scorer, spec, fit.keep, in_order=True)
    yield from _prefill_packed(scorer, spec, tokens, fit.keep, fit.through)
    return added


def _prefill_packed(seq: Seq, kv: TokenCells, tokens: Sequence[int], keep: np.ndarray,
                    through: int) -> TurnSteps[int]:
    """Prefill ``tokens[len(kv.tokens):through]`` that ``keep`` keeps, packed after the cache."""
    q = len(kv.tokens)
    if through <= q:
        return 0
    rel = np.flatnonzero(keep[q:through])
    base = kv.next_pos
    if rel.size:
        yield from sparse_prefill(seq, tokens[q:through], rel, "compact", base)
    kv.extend_kept(tokens[q:through], rel, base, compact=True)
    return int(rel.size)
