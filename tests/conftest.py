"""Shared fixtures: real models (fetched by the README's test command) and tiny
models derived from the real speculator with the ``gguf`` package."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from core import model_store
from core.config import EngineConfig
from core.engine import Engine
from core.gguf_tools import truncate_blocks


def real_model(spec: model_store.ModelSpec) -> Path:
    path = model_store.model_path(spec)
    if not model_store.is_verified(spec, path):
        pytest.fail(f"{spec.name} missing at {path}: run `specgate fetch-models` (the README's test "
                    "command does this)")
    return path


def derived_dir() -> Path:
    d = Path(os.environ.get("SPECGATE_DERIVED_DIR", model_store.models_dir() / "derived"))
    d.mkdir(parents=True, exist_ok=True)
    return d


def tiny(n_blocks: int) -> Path:
    """A copy of the real speculator with only its first ``n_blocks`` blocks (cached)."""
    src = real_model(model_store.SPECULATOR)
    dst = derived_dir() / f"qwen0.5b-{n_blocks}blk-{model_store.SPECULATOR.sha256[:8]}.gguf"
    if not dst.exists():
        truncate_blocks(src, dst, n_blocks)
    return dst


@pytest.fixture(scope="session")
def tiny_speculator() -> Path:
    return tiny(2)


@pytest.fixture(scope="session")
def tiny_target() -> Path:
    return tiny(3)


@pytest.fixture(scope="session")
def small_model() -> Path:
    return real_model(model_store.SMALL)


@pytest.fixture(scope="session")
def tiny_engine(tiny_speculator: Path, tiny_target: Path):
    engine = Engine(EngineConfig(target=str(tiny_target), speculator=str(tiny_speculator),
                                 n_ctx=4096, n_threads=2, calibrate_tokens=64))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def smol_engine(small_model: Path):
    """A real, coherent small model as both speculator and target: greedy outputs
    without the near-ties of the truncated models (for exact-equality tests)."""
    engine = Engine(EngineConfig(target=str(small_model), speculator=str(small_model),
                                 n_ctx=4096, n_threads=2, calibrate_tokens=64))
    yield engine
    engine.close()
