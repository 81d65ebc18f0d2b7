"""What every benchmark result carries: the commit and command, the machine, the model files, and\nprogress output."""

from __future__ import annotations

import os
import platform
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from core.config import EngineConfig
from core.machine import cpu_flags, cpu_model, source_commit
from core.models import model_files


def machine() -> dict[str, Any]:
    cpu = cpu_model()
    mem_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    import llama_cpp
    return {"cpu": cpu, "cores": os.cpu_count(), "mem_gib": round(mem_gib, 1), "python": platform.python_version(),
            "platform": platform.platform(), "llama_cpp_python": llama_cpp.__version__, "cpu_flags": cpu_flags()}


def provenance() -> dict[str, Any]:
    """The code and the command a result came from."""
    return {"commit": source_commit(), "command": [Path(sys.argv[0]).name, *sys.argv[1:]]}


def model_info(path: str) -> dict[str, Any]:
    p = Path(path)
    known = next((m for m in model_files.ALL_MODELS if m.filename == p.name), None)
    if known is not None and model_files.is_verified(known, p):
        sha = known.sha256
    else:
        sha = model_files.sha256_of(p)
    return {"path": str(p), "size": p.stat().st_size, "sha256": sha}


def write_result(path: Path, scenario: str, payload: dict[str, Any], models: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"scenario": scenario, "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **provenance(),
           "machine": machine(), "models": {k: model_info(v) for k, v in models.items()}, **payload}
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY))
    progress(f"wrote {path}")


def earlier_rows(path: Path, params: dict[str, Any], key: str, rerun: Callable[[dict[str, Any]], bool]
                 ) -> list[dict[str, Any]]:
    """The rows under ``key`` of an earlier result at ``path`` with the same ``params`` that
    this run does not redo: rerunning some arms or levels keeps the others' figures."""
    if not path.exists():
        return []
    old = orjson.loads(path.read_bytes())
    return [r for r in old.get(key, []) if not rerun(r)] if old.get("params") == params else []


def free_port() -> int:
    """A free loopback port (tests and benches start servers on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


_T0 = time.perf_counter()


def progress(message: str) -> None:
    sys.stderr.write(f"[{time.perf_counter() - _T0:7.1f}s] {message}\n")
    sys.stderr.flush()


def bench_engine(**flags: str | None) -> EngineConfig:
    """The engine the benches serve: the default models (or ``flags``: target, speculator,
    scorer), with the settings a bench passes on to ``specgate serve``."""
    from core.loader import build

    built = model_files.with_default_models(build(EngineConfig, flags))
    return EngineConfig(target=built.target, speculator=built.speculator, n_threads=built.n_threads,
                        scorer=built.scorer, scoring_window=built.scoring_window)


@contextmanager
def serving_target(n_ctx: int) -> Iterator[tuple[EngineConfig, Any]]:
    """The default target in the serving layout (4 slots of split KV streams, flash attention,
    batches of 512), for the ops/ scripts that time llama.cpp calls on it: (config, context)."""
    from core.llama.context import Context  # llama.cpp only where a script asks for it
    from core.llama.model import Model
    cfg = model_files.with_default_models(EngineConfig())
    model = Model(cfg.target)
    ctx = Context(model, n_ctx=n_ctx, n_batch=512, n_ubatch=512, n_threads=cfg.n_threads, flash_attn=True,
                  n_seq=4, unified=False)
    try:
        yield cfg, ctx
    finally:
        ctx.close()
        model.close()
