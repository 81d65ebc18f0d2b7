"""The scoring model's side of a turn: keeping each sequence in step with the prompt
(cut back to the common prefix, or rebuilt as the sparse target's mirror when that
is cheaper) and capturing the attention rows SpecPrefill scores from.  The target's
side of the turn is the engine's (core.engine)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np

from core.kv import cells
from core.kv.positions import (
    SessionKV,
    SpeculatorSync,
    TokenCells,
    cached_indices,
    plan_speculator_sync,
)
from core.kv.scoring_window import ScoringWindow
from core.kv.sparse_prefill import measured_prefill
from core.llama.capture import AttentionCapture
from core.llama.context import Context, Seq
from core.results import Timings
from core.spans import common_prefix, runs
from core.specprefill.cost_model import Costs
from core.steps import Tokens, TurnSteps


class Speculator:
    def __init__(self, ctx: Context, capture: AttentionCapture, costs: Costs, calls: Callable[[int], int],
                 window: ScoringWindow | None = None) -> None:
        """``calls(n)``: llama_decode calls a prefill of ``n`` tokens takes; ``window``: long
        prefills attend through it (core.kv.scoring_window)."""
        self.ctx, self.capture, self.costs, self.calls, self.window = ctx, capture, costs, calls, window

    def span(self, base: int, n: int) -> int:
        """The most cells a token of a prefill of ``n`` after ``base`` will attend to (0: all)."""
        return self.window.span if self.window is not None and self.window.applies(base, n) else 0

    def plan_sync(self, kv: SessionKV, tokens: Sequence[int]) -> SpeculatorSync:
        """How the speculator reaches ``tokens`` for scoring: as it is, or rebuilt as the
        target's mirror when that is cheaper by the measured costs (core.kv.positions)."""
        return plan_speculator_sync(kv.speculator, kv.target, tokens, self.costs.speculator.seconds, self.calls,
                                    self.costs.speculator.bridge_s, self.ctx.n_ctx - 1)


    def capture_steps(self, kv_all: SessionKV, tokens: tuple[int, ...], lookahead: int, t: Timings,
                      slot: int = 0, sync: SpeculatorSync | None = None) -> TurnSteps[list[np.ndarray]]:
        """Prefill the speculator's missing tokens without capture (a request to the step
        loop), then capture the last prompt token's row and ``lookahead`` greedy steps:
        [n_layer, n_head, n] each, one column per logical token (zero where the speculator
        holds no cell, see core.kv.positions).  The captured steps run inline: the capture
        hook must see this sequence's row alone."""
        seq, n, kv = self.ctx.seq(slot), len(tokens), kv_all.speculator
        t0 = time.perf_counter()
        sync = sync or self.plan_sync(kv_all, tokens[:-1])
        base = yield from self.sync(seq, kv, tokens[:-1], t, sync)
        t1 = time.perf_counter()
        columns = np.asarray(cached_indices(kv) + [n - 1])  # cell i holds logical token columns[i]
        steps = []
        tok = tokens[-1]
        for step in range(lookahead + 1):
            pos = base + step
            if pos >= seq.n_ctx:
                break
            self.capture.start(columns.size)
            t_step = time.perf_counter()
            try:
                seq.decode([tok], pos)
            finally:
                rows = self.capture.stop()
            self.costs.speculator_step.observe(1, columns.size + step, 1, time.perf_counter() - t_step)
            steps.append(rows if columns.size == n else _scatter(rows, columns, n))
            tok = int(np.argmax(seq.logits()))
        cells.cut_from(seq, base + 1)  # lookahead tokens are not context
        kv.extend([tokens[-1]], [base])
        t.speculator_prefill_n += 1
        t2 = time.perf_counter()
        t.speculator_prefill_ms = (t1 - t0) * 1e3
        t.lookahead_ms = (t2 - t1) * 1e3
        return steps

    def sync(self, seq: Seq, kv: TokenCells, tokens: Sequence[int], t: Timings,
                         sync: SpeculatorSync | None = None) -> TurnSteps[int]:
        """Bring the speculator's sequence to exactly ``tokens``, rebuilt as ``sync`` says;
        returns the next position.  Every such prefill also refreshes the measured
        speculator speed."""
        if sync is not None and sync.rebuild is not None:
            yield from self._mirror(seq, kv, tokens[:sync.start], np.asarray(sync.rebuild), t, sync.packed)
        else:
            cells.rollback(seq, kv, min(common_prefix(kv.tokens, tokens), len(tokens)))
        delta = tokens[len(kv.tokens):]
        base = kv.next_pos
        if delta:
            t0 = time.perf_counter()
            span = self.span(base, len(delta))
            if span and self.window is not None:
                yield from self.window.prefill(seq, delta, base)
                t.speculator_windowed_n = len(delta)
            else:
                yield Tokens(seq, delta, base, logits=False)
            self.costs.speculator.observe(len(delta), base, self.calls(len(delta)), time.perf_counter() - t0, span)
            kv.extend(delta, range(base, base + len(delta)))
            t.speculator_prefill_n += len(delta)
        return base + len(delta)

    def _mirror(self, seq: Seq, kv: TokenCells, history: Sequence[int], held: np.ndarray,
                t: Timings, packed: bool = False) -> TurnSteps[None]:
        """Empty the speculator's sequence and prefill only ``history[held]`` (the target's
        cells) at their logical positions (``packed``: at 0..K-1, as a packed target holds
        them), so later tokens attend to what the target kept."""
        cells.reset(seq, kv)
        n_runs = 1 if packed else len(runs(held))
        yield from measured_prefill(seq, history, held, "compact" if packed else "original", 0,
                                    self.costs.speculator, 0, n_runs)
        kv.extend_kept(history, held, 0, compact=packed)
        t.speculator_prefill_n += int(held.size)
        t.speculator_mirrored_n = int(held.size)


def _scatter(rows: np.ndarray, columns: np.ndarray, n: int) -> np.ndarray:
    """Captured rows over cells -> rows over ``n`` logical tokens (zero where no cell)."""
    out = np.zeros(rows.shape[:2] + (n,), dtype=rows.dtype)
    out[:, :, columns] = rows[:, :, :columns.size]
    return out
