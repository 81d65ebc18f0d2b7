"""What a bridge costs as the sequence grows: moving one position label (the whole sequence's
saved state out and back, where slots' cells are private) and one K-shift, on the real target
in the serving layout (4 slots of split KV streams, the trained context), after 128 cells (what
start-up calibrates with) and at depth.

    .venv/bin/python ops/bench_move_cost.py [MAX_CELLS] [REPEATS]

The sequence is filled with a source file's tokens, 1,024 at a time; at each checkpoint a
move is timed the way start-up times it (``core.kv.sparse_prefill.move_cost``, best of
REPEATS), and so is a K-shift (the step after a shifted cell, less a plain step), and so are
runs of 1, 16, 64 and 512 tokens decoded there (a sparse prefill's runs).  Writes
results/bench/move_cost.json: seconds per move, and per cell, against cells held; a run's
seconds per token against its length and the cells before it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from bench.common import serving_target, write_result
from core import corpus
from core.kv.sparse_prefill import move_cost, shift_one
from core.llama.context import Seq

OUT = Path("results/bench/move_cost.json")
CHECKPOINTS = (128, 1024, 2048, 4096, 8192, 12288, 16384, 24576)
RUN_TOKENS = (1, 16, 64, 512)  # a decode step, short and typical sparse-prefill runs, a full batch


def shift_cost(seq: Seq, cells: int, token: int) -> float:
    """One K-shift's cost in a sequence of ``cells`` cells: the step after it, less a step."""
    seq.decode([token], cells)
    t0 = time.perf_counter()
    seq.decode([token], cells + 1)
    step = time.perf_counter() - t0
    shift_one(seq, cells + 1)
    t0 = time.perf_counter()
    seq.decode([token], cells + 3)
    shifted = time.perf_counter() - t0
    seq.remove_cells(cells, -1)
    return max(0.0, shifted - step)


def run_s(seq: Seq, cells: int, tokens: list[int], n: int) -> float:
    """One sparse-prefill run of ``n`` tokens after ``cells`` cells, taken out again."""
    t0 = time.perf_counter()
    seq.decode(tokens[:n], cells)
    seconds = time.perf_counter() - t0
    seq.remove_cells(cells, -1)
    return seconds


def move_s(seq: Seq, cells: int) -> float:
    per_move, per_cell = move_cost(seq, cells)
    return per_move + per_cell * cells


def main() -> None:
    max_cells = int(sys.argv[1]) if len(sys.argv) > 1 else 8192
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    with serving_target(32768) as (cfg, ctx):
        model = ctx.model
        text = "".join(corpus.read(f"stdlib:{m}.py") for m in ("difflib", "argparse", "typing", "inspect"))
        tokens = model.tokenize(text, add_special=False)[:max_cells]
        seq, filled = ctx.seq(0), 0
        rows: list[dict[str, Any]] = []
        for cells in (c for c in CHECKPOINTS if c <= len(tokens)):
            t0 = time.perf_counter()
            seq.decode(tokens[filled:cells], filled)
            fill_s, filled = time.perf_counter() - t0, cells
            best = min(move_s(seq, cells) for _ in range(repeats))
            shift = min(shift_cost(seq, cells, tokens[0]) for _ in range(repeats))
            runs = {n: min(run_s(seq, cells, tokens, n) for _ in range(repeats))
                    for n in RUN_TOKENS if n <= len(tokens)}
            rows.append({"cells": cells, "move_s": round(best, 4), "move_us_per_cell": round(best / cells * 1e6, 2),
                         "shift_s": round(shift, 4), "fill_s": round(fill_s, 1),
                         "run_s": {str(n): round(v, 3) for n, v in runs.items()},
                         "run_ms_per_token": {str(n): round(v / n * 1e3, 1) for n, v in runs.items()}})
            print(rows[-1], flush=True)
        first = float(rows[0]["move_us_per_cell"])
        write_result(OUT, "move_cost", {
            "layout": "4 slots, split streams, n_ctx 32768, flash attention", "repeats": repeats, "rows": rows,
            "per_cell_vs_128": {str(r["cells"]): round(r["move_us_per_cell"] / first, 2) for r in rows}},
            {"target": cfg.target})


if __name__ == "__main__":
    main()
