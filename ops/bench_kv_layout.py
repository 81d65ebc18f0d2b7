"""Does one session's decode step cost more when other slots hold KV?  Split streams
against one unified pool, on the fetched 1.5B target.

    .venv/bin/python ops/bench_kv_layout.py [tokens_per_other_slot]   # default 6000
    -> prints a table and writes results/bench/kv_layout.json

Slot 0 holds a 512-token session and decodes one token at a time (the mean of 8
steps, each rolled back).  Slots 1-3 are then filled with ``tokens_per_other_slot``
tokens each: a prefill in slot 1, its saved state restored into slots 2 and 3
(distinct cells, as three real sessions would hold).  Each layout prefills its own:
a sequence saved from split streams does not restore into a unified cache.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from bench.common import write_result
from core.llama.backend import init_backend
from core.llama.context import Context
from core.llama.model import Model
from core.models import model_files

TEXT = "The harbour log records each ship, its cargo, its berth and the hour it left. "


def step_ms(ctx: Context, token: int, n: int, steps: int = 8) -> float:
    seq = ctx.seq(0)
    t0 = time.perf_counter()
    for j in range(steps):
        seq.decode([token], n + j)
    ms = (time.perf_counter() - t0) / steps * 1e3
    seq.remove_from(n)
    return ms


def measure(model: Model, unified: bool, session: list[int], other: list[int]) -> dict:
    ctx = Context(model, n_ctx=8192, n_batch=512, n_ubatch=512, n_threads=2, flash_attn=True, n_seq=4,
                  unified=unified)
    try:
        ctx.seq(0).decode(session, 0)
        alone = step_ms(ctx, session[0], len(session))
        ctx.seq(1).decode(other, 0, logits_last=False)
        blob = ctx.seq(1).save()
        for i in (2, 3):
            ctx.seq(i).load_state(blob)
        beside = step_ms(ctx, session[0], len(session))
    finally:
        ctx.close()
    return {"layout": "unified" if unified else "split", "alone_ms": round(alone, 1),
            "beside_others_ms": round(beside, 1), "ratio": round(beside / alone, 2)}


def main() -> None:
    n_other = int(sys.argv[1]) if len(sys.argv) > 1 else 6000
    init_backend()
    model_path = str(model_files.model_path(model_files.TARGET))
    model = Model(model_path)
    tokens = model.tokenize(TEXT * (n_other // 12 + 50), add_special=False)
    session, other = tokens[:512], tokens[:n_other]
    rows = []
    for unified in (False, True):
        rows.append(r := measure(model, unified, session, other))
        print(f"{r['layout']:8s} alone {r['alone_ms']:7.1f} ms/step   beside 3 x {n_other} tokens "
              f"{r['beside_others_ms']:7.1f} ms/step   x{r['ratio']}")
    write_result(Path("results/bench/kv_layout.json"), "kv_layout",
                 {"session_tokens": len(session), "other_slots": 3, "tokens_per_other_slot": n_other, "rows": rows},
                 {"target": model_path})
    model.close()


if __name__ == "__main__":
    main()
