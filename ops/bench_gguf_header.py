"""How long does reading a model file's header metadata take, as every server and CLI start
does two or three times (the trained context, the KV bytes per token of each model)?

    .venv/bin/python ops/bench_gguf_header.py
    -> prints the times and writes results/bench/gguf_header.json

gguf's ``GGUFReader`` (the reader used until f89f2b7) against ``core.llama.gguf_file
.scalar_fields``, which steps over the tokenizer's arrays; each once on the real pair.
"""

from __future__ import annotations

import time
from pathlib import Path

from gguf import GGUFReader

from bench.common import write_result
from core.llama.gguf_file import scalar_fields
from core.models import model_files


def timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return round(time.perf_counter() - t0, 3)


def main() -> None:
    rows, models = [], {}
    for spec in (model_files.TARGET, model_files.SPECULATOR):
        path = model_files.model_path(spec)
        models[spec.name] = str(path)
        row = {"model": spec.name, "gguf_reader_s": timed(lambda p=path: GGUFReader(str(p), "r")),
               "scalar_fields_s": timed(lambda p=path: scalar_fields(p))}
        print(row)
        rows.append(row)
    write_result(Path("results/bench/gguf_header.json"), "gguf_header", {"rows": rows}, models)


if __name__ == "__main__":
    main()
