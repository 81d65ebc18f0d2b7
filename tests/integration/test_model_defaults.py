"""Defaults that depend on the model files: the context is the target's trained one, and at
that context only as many slots as fit in free memory are kept."""

from __future__ import annotations

from pathlib import Path

from core.config import EngineConfig, kv_cache_bytes
from core.llama.model import Model
from core.loader import override
from core.models import model_files


def test_metadata_sizes_the_kv_cache_as_the_loaded_model_does(tiny_target: Path, small_model: Path):
    for path in (tiny_target, small_model):
        model = Model(str(path))
        try:
            assert model_files.kv_bytes_per_token(path) == model.kv_bytes_per_token
            assert model_files.trained_context(path) == model.n_ctx_train
        finally:
            model.close()


def test_the_default_context_is_the_trained_one_and_slots_fit_free_memory(tiny_target, tiny_speculator,
                                                                          monkeypatch):
    config = EngineConfig(target=str(tiny_target), speculator=str(tiny_speculator), slots=8)
    full = model_files.with_default_models(config)
    assert full.n_ctx == 32768 and full.slots == 8  # Qwen2.5's trained context; this machine holds 8 tiny slots
    per_token = model_files.kv_bytes_per_token(tiny_target), model_files.kv_bytes_per_token(tiny_speculator)
    weights = tiny_target.stat().st_size + tiny_speculator.stat().st_size
    room = kv_cache_bytes(override(full, slots=3), *per_token) + weights + 1
    monkeypatch.setattr("core.machine.available_bytes", lambda: room)
    assert model_files.with_default_models(config).slots == 3
    monkeypatch.setattr("core.machine.available_bytes", lambda: 1)
    assert model_files.with_default_models(config).slots == 1  # never below one: the engine's check says why
    assert model_files.with_default_models(override(config, n_ctx=4096)).slots == 8  # a context asked for: as asked
