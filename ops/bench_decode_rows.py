"""Batched decode cost of the target against the number of decoding slots (split streams).

    .venv/bin/python ops/bench_decode_rows.py
    -> prints ms per step and tokens/s for 1, 2, 4, 8 rows, and writes results/bench/decode_rows.json

The same calls the step loop makes (Context.decode_rows), on the fetched 1.5B target.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import write_result
from core.llama.backend import init_backend
from core.llama.context import Context
from core.llama.model import Model
from core.models import model_files


def main() -> None:
    init_backend()
    model_path = str(model_files.model_path(model_files.TARGET))
    model = Model(model_path)
    tokens = model.tokenize("Count from one to five. " * 20)
    ctx = Context(model, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=True, n_seq=8,
                  unified=False)
    for i in range(8):
        ctx.seq(i).decode(tokens, 0)
    n, one, rows = len(tokens), 0.0, []
    for k in (1, 2, 4, 8):
        t0 = time.perf_counter()
        for j in range(6):
            ctx.decode_rows([(i, [tokens[0]], n + j, True) for i in range(k)])
        step = (time.perf_counter() - t0) / 6
        for i in range(k):
            ctx.seq(i).remove_from(n)
        one = one or step
        print(f"{k} rows: {step * 1e3:.1f} ms/step, {k / step:.2f} tok/s, {k * one / step:.2f}x one row")
        rows.append({"rows": k, "ms_per_step": round(step * 1e3, 1), "tok_s": round(k / step, 2),
                     "vs_one_row": round(k * one / step, 2)})
    ctx.close()
    model.close()
    write_result(Path("results/bench/decode_rows.json"), "decode_rows",
                 {"context_tokens": n, "n_threads": 2, "rows": rows}, {"target": model_path})


if __name__ == "__main__":
    main()
