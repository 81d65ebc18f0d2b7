"""Sorting-free (bisection) top-p selection against a sort, vectorized numpy."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import progress, write_result
from core.decoding.specattn import top_p_mask, top_p_mask_sorted


def best_of(fn: Any, attn: np.ndarray, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(attn, 0.95)
        times.append(time.perf_counter() - t0)
    return min(times)


def rows_of(rng: np.random.Generator, n: int, sink: bool) -> np.ndarray:
    """28 rows (one per target layer): Dirichlet(0.1), or half the mass on a sink cell
    with the rest spread thin (Dirichlet(0.5)), as real attention rows look."""
    attn = rng.dirichlet(np.full(n, 0.5 if sink else 0.1), size=28)
    if sink:
        attn = np.concatenate([np.full((28, 1), 1.0), attn], axis=1)[:, :n] * 0.5
    return attn.astype(np.float32)


def linear(attn: np.ndarray, p: float) -> np.ndarray:
    return top_p_mask(attn, p, scale="linear")


def run(out: Path) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    rows = []
    for sink in (False, True):
        for n in (1024, 4096, 16384, 65536):
            attn = rows_of(rng, n, sink)
            progress(f"topp: n={n} sink={sink}")
            bisect, lin, sort = (best_of(f, attn) for f in (top_p_mask, linear, top_p_mask_sorted))
            rows.append({"n_keys": n, "rows": 28, "sink": sink, "bisection_ms": round(bisect * 1e3, 3),
                         "linear_bisection_ms": round(lin * 1e3, 3), "sort_ms": round(sort * 1e3, 3),
                         "sort_over_bisection": round(sort / bisect, 2),
                         "kept_bisection": int(top_p_mask(attn, 0.95).sum()),
                         "kept_linear_bisection": int(linear(attn, 0.95).sum()),
                         "kept_sort": int(top_p_mask_sorted(attn, 0.95).sum())})
    write_result(out, "topp", {"rows": rows}, {})
    return rows
