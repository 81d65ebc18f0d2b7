"""The scoring model's prefill of one prompt in full and through a scoring window
(core.kv.scoring_window: the first 64 cells and the last W), chunk by chunk, in one
one-slot context with a view, as the engine's scratch context runs it.

    .venv/bin/python ops/scoring_window_cost.py 9400 2048     # tokens of Python source, window

Prints each chunk's seconds and the totals for both, and the final logits' first values
(they differ: the window changes the keys above the first layer).
"""

from __future__ import annotations

import sys
import time

from bench.textgen import source_code
from core.kv.scoring_window import view_spans
from core.llama.backend import init_backend
from core.llama.context import Context
from core.llama.model import Model
from core.models import model_files
from core.models.scorer_cuts import scoring_model


def main() -> None:
    n, window = int(sys.argv[1]), int(sys.argv[2])
    init_backend()
    spec = str(model_files.model_path(model_files.SPECULATOR))
    model = Model(scoring_model("speculator-q4_0", str(model_files.model_path(model_files.TARGET)), spec))
    tokens = model.tokenize(source_code(int(n * 3.6)))[:n]
    n = len(tokens)
    ctx = Context(model, n_ctx=n + 64, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=True, views=True)
    ctx.decode(tokens[:32], 0)  # pages the weights in
    full = ctx.seq(0)
    for mode in ("window", "full"):
        ctx.clear_cells()
        times = []
        for off in range(0, n, 512):
            part, last = tokens[off:off + 512], off + 512 >= n
            t0 = time.perf_counter()
            if mode == "window":
                full.make_view(view_spans(off, window))
                full.view().decode(part, off, logits_last=last)
                full.commit_view(off, off + len(part))
            else:
                full.decode(part, off, logits_last=last)
            times.append(time.perf_counter() - t0)
        print(f"{mode} n={n} window={window}: {sum(times):.1f}s  chunks " + " ".join(f"{t:.2f}" for t in times)
              + f"  logits[:3] {ctx.logits()[:3]}", flush=True)
        full.drop_view()
    ctx.close()
    model.close()


if __name__ == "__main__":
    main()
