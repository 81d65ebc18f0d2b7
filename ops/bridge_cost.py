"""What a sparse prefill's bridges cost, moved as position labels or as K-shifts, on the
real target in the serving layout (4 slots of split KV streams, n_ctx 8192).

    .venv/bin/python ops/bridge_cost.py [N_TOKENS] [REPEATS]

The same kept tokens (25 random 32-token chunks of a source file, plus its first 64 and
last 32 tokens, seeded) are prefilled at their original positions both ways, alternately;
each arm's time includes the decode after it, which pays a K-shift still pending.  Writes
results/bench/bridge_cost.json.  The logits differ: a K-shift shows each run the bridge cell
at the borrowed position, a moved label at its own.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

from bench.common import serving_target, write_result
from core import corpus
from core.kv.sparse_prefill import sparse_prefill
from core.spans import runs
from core.steps import drive

OUT = Path("results/bench/bridge_cost.json")


def kept_tokens(n: int, seed: int = 0) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    for c in np.random.default_rng(seed).choice(n // 32, min(25, n // 32), replace=False):
        mask[c * 32:(c + 1) * 32] = True
    mask[:64] = mask[-32:] = True
    return np.flatnonzero(mask)


def main() -> None:
    n_tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    repeats = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    with serving_target(8192) as (cfg, ctx):
        model = ctx.model
        tokens = model.tokenize(corpus.read("stdlib:difflib.py"), add_special=False)[:n_tokens]
        kept = kept_tokens(len(tokens))
        seq, logits = ctx.seq(1), {}
        rows: list[dict[str, float | str]] = []
        for _ in range(repeats):
            for relabel in (False, True):
                seq.clear_cells()
                t0 = time.perf_counter()
                n_past, _ = drive(sparse_prefill(seq, tokens, kept, "original", 0, relabel))
                logits[relabel] = seq.logits().copy()
                seq.decode([tokens[0]], n_past)
                seconds = round(time.perf_counter() - t0, 3)
                rows.append({"bridge": "move" if relabel else "k-shift", "seconds": seconds})
                print(rows[-1], flush=True)
        diff = float(np.abs(logits[True] - logits[False]).max())
        best = {b: min(float(r["seconds"]) for r in rows if r["bridge"] == b) for b in ("k-shift", "move")}
        write_result(OUT, "bridge_cost", {
            "tokens": len(tokens), "kept": int(kept.size), "runs": len(runs(kept)), "cells_in_context": 4 * 8192,
            "rows": rows, "best_s": best, "kept_per_second": {b: round(kept.size / s, 1) for b, s in best.items()},
            "speedup": round(best["k-shift"] / best["move"], 2), "max_logit_difference": round(diff, 3),
            "same_argmax": bool(logits[True].argmax() == logits[False].argmax())}, {"target": cfg.target})


if __name__ == "__main__":
    main()
