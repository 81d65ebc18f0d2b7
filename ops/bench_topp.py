"""Sorting-free (bisection) top-p selection against a sort, vectorized numpy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from core.specattn import top_p_mask, top_p_mask_sorted
from ops.bench_common import progress, write_result


def best_of(fn: Any, attn: np.ndarray, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(attn, 0.95)
        times.append(time.perf_counter() - t0)
    return min(times)


def run(out: Path) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for n in (1024, 4096, 16384, 65536):
        attn = rng.dirichlet(np.full(n, 0.1), size=28).astype(np.float32)  # one row per target layer
        progress(f"topp: n={n}")
        bisect = best_of(top_p_mask, attn)
        sort = best_of(top_p_mask_sorted, attn)
        rows.append({"n_keys": n, "rows": 28, "bisection_ms": round(bisect * 1e3, 3),
                     "sort_ms": round(sort * 1e3, 3), "sort_over_bisection": round(sort / bisect, 2),
                     "kept_bisection": int(top_p_mask(attn, 0.95).sum()),
                     "kept_sort": int(top_p_mask_sorted(attn, 0.95).sum())})
    write_result(out, "topp", {"rows": rows}, {})
    return rows
