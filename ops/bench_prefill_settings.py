"""One model's prefill speed under each setting worth choosing between, in one process:
flash attention on with n_ubatch 512, 1024, 2048, off with 512, and on with a q8_0 KV cache.

    .venv/bin/python ops/bench_prefill_settings.py spec 4000      # or: target 4000 [settings, e.g. fa512,q8]
    .venv/bin/python ops/bench_prefill_settings.py /path/to/model.gguf 4000 fa512   # any GGUF file

The prompt is Python source (bench.textgen.source_code).  Prints one line per setting.
"""

from __future__ import annotations

import sys
import time

from bench.textgen import source_code
from core.llama.backend import init_backend
from core.llama.context import Context
from core.llama.model import Model
from core.models import model_files

SETTINGS = {"fa512": (True, 512, "f16"), "fa1024": (True, 1024, "f16"), "fa2048": (True, 2048, "f16"),
            "nofa512": (False, 512, "f16"), "q8": (True, 512, "q8_0")}  # (flash attention, n_ubatch, KV type)


def main() -> None:
    which, n = sys.argv[1], int(sys.argv[2])
    names = sys.argv[3].split(",") if len(sys.argv) > 3 else list(SETTINGS)
    init_backend()
    spec = model_files.SPECULATOR if which == "spec" else model_files.TARGET
    model = Model(which if which.endswith(".gguf") else str(model_files.model_path(spec)))
    tokens = model.tokenize(source_code(int(n * 3.6)))[:n]
    for name in names:
        fa, ub, kv = SETTINGS[name]
        ctx = Context(model, n_ctx=n + 64, n_batch=max(ub, 512), n_ubatch=ub, n_threads=2, flash_attn=fa,
                      kv_type=kv)
        ctx.decode(tokens[:32], 0)  # pages the weights in
        ctx.clear_cells()
        t0 = time.perf_counter()
        ctx.decode(tokens, 0, logits_last=False)
        dt = time.perf_counter() - t0
        print(f"{model.path.name} fa={fa} ubatch={ub} kv={kv} n={len(tokens)}: {dt:.1f}s "
              f"{len(tokens) / dt:.1f} t/s", flush=True)
        ctx.close()
    model.close()


if __name__ == "__main__":
    main()
