"""Prefill cost of each model with flash attention off and on: 0 -> N tokens, then N -> 2N.

    .venv/bin/python ops/bench_flash_attn.py [N]     # N defaults to 3500; prints seconds per span

Attention capture (scoring) needs flash attention off in the speculator's context, so this
is what that costs; the target runs with ``target_flash_attn`` (auto: measured by
``specgate calibrate --prefill``).  The two settings alternate their order between the
models, since the first run of a process can be slower.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from core.llama.backend import init_backend
from core.llama.context import Context
from core.llama.model import Model
from core.models import model_files

TEXT = Path(__file__).resolve().parent.parent / "core" / "texts" / "specprefill_guide.txt"


def spans(model: Model, tokens: list[int], n: int, flash_attn: bool) -> tuple[float, float]:
    ctx = Context(model, n_ctx=2 * n + 64, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=flash_attn)
    try:
        ctx.decode(tokens[:32], 0)  # pages the weights in
        ctx.clear_cells()
        t0 = time.perf_counter()
        ctx.decode(tokens[:n], 0)
        t1 = time.perf_counter()
        ctx.decode(tokens[n:2 * n], n)
        return t1 - t0, time.perf_counter() - t1
    finally:
        ctx.close()


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3500
    init_backend()
    for k, spec in enumerate((model_files.SPECULATOR, model_files.TARGET)):
        model = Model(str(model_files.model_path(spec)))
        tokens = model.tokenize(TEXT.read_text() * 20, add_special=False)[: 2 * n]
        for flash_attn in (True, False) if k % 2 == 0 else (False, True):
            first, second = spans(model, tokens, n, flash_attn)
            print(f"{model.path.name}: flash attention {'on ' if flash_attn else 'off'}: "
                  f"0->{n} {first:.1f} s, {n}->{2 * n} {second:.1f} s")
        model.close()


if __name__ == "__main__":
    main()
