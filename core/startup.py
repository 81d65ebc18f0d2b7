"""What the engine checks and measures once, at start-up: that both models share a
vocabulary, that the slots' KV caches fit in memory, and the seed of the prefill cost
functions."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from core.config import EngineConfig, kv_cache_bytes
from core.errors import ConfigError, VocabMismatch
from core.kv import cells
from core.kv.sparse_prefill import move_cost, shift_one
from core.llama.context import Context
from core.llama.model import Model
from core.machine import available_bytes
from core.specprefill.cost_model import Costs

log = structlog.get_logger("specgate.engine")
VOCAB_PROBE = "SpecGate probe: fn get_weather(city) -> {\"temp\": 21.5} 東京 ✓"
CALIBRATION_TEXT = (
    "The quick brown fox jumps over the lazy dog while the committee reviews the "
    "quarterly report on distributed systems, caching layers and network latency. "
)


def check_same_vocab(a: Model, b: Model) -> None:
    if a.n_vocab != b.n_vocab:
        raise VocabMismatch(f"vocabularies differ: {a.path.name} has {a.n_vocab} tokens, "
                            f"{b.path.name} has {b.n_vocab}")
    if a.tokenize(VOCAB_PROBE) != b.tokenize(VOCAB_PROBE):
        raise VocabMismatch(f"{a.path.name} and {b.path.name} tokenize the same text differently")


def check_memory(config: EngineConfig, target: Model, speculator: Model) -> None:
    """Refuse a slot configuration whose KV caches and weights do not fit in memory."""
    kv = kv_cache_bytes(config, target.kv_bytes_per_token, speculator.kv_bytes_per_token)
    need, have = kv + target.size_bytes + speculator.size_bytes, available_bytes()
    if have is not None and need > have:
        mib = 1 << 20
        raise ConfigError(f"{config.slots} slots x {config.n_ctx} tokens need {kv // mib} MiB of KV cache "
                          f"(+ {(target.size_bytes + speculator.size_bytes) // mib} MiB of weights), but only "
                          f"{have // mib} MiB of memory is available: lower --slots or --n-ctx")


def calibrate(target_ctx: Context, speculator_ctx: Context, costs: Costs, calls: Callable[[int], int],
              n_tokens: int) -> None:
    """Seed the cost functions: both models' prefill of ``n_tokens``, the speculator's
    one-token step after it, what one K-shift costs each context (a step after a
    moved cell, less a plain step) and what moving a label costs per cell, each timed
    twice and the faster kept (other load only ever slows a run down); ``calls(n)``: the
    llama_decode calls a prefill of ``n`` tokens takes.  Every real prefill
    and step refines them (core.specprefill.cost_model)."""
    text = CALIBRATION_TEXT * (n_tokens // 20 + 2)
    tokens = target_ctx.model.tokenize(text, add_special=False)[:n_tokens]
    n = len(tokens)
    for ctx, cost in ((speculator_ctx, costs.speculator), (target_ctx, costs.target)):
        cells.empty(ctx)
        ctx.decode(tokens[:32], 0)  # the first decode pages the mmap'd weights in
        prefill, step, shifted = float("inf"), float("inf"), float("inf")
        for _ in range(2):
            cells.empty(ctx)
            t0 = time.perf_counter()
            ctx.decode(tokens, 0)
            t1 = time.perf_counter()
            ctx.decode([tokens[0]], n)
            t2 = time.perf_counter()
            shift_one(ctx.seq(0), n)
            t3 = time.perf_counter()
            ctx.decode([tokens[1]], n + 2)
            prefill, step = min(prefill, t1 - t0), min(step, t2 - t1)
            shifted = min(shifted, time.perf_counter() - t3)
        cost.observe(n, 0, calls(n), prefill)
        cost.shift_s = max(0.0, shifted - step)
        # the prefill, the step and the shifted step: a move's cost per cell, or per move
        cost.move_s, cost.move_s_per_cell = move_cost(ctx.seq(0), n + 2)
        if ctx is speculator_ctx:
            costs.speculator_step.observe(1, n, 1, step)
        cells.empty(ctx)
        # a sparse prefill's bridge: a K-shift of the whole context, or a moved label (core.kv.sparse_prefill)
        log.info("bridge_costs", model=ctx.model.path.name, shift_s=round(cost.shift_s, 4),
                 move_s=round(cost.move_s, 5), move_us_per_cell=round(cost.move_s_per_cell * 1e6, 3))
