"""Flash attention chosen by measurement (core.models.prefill_settings, ``specgate
calibrate --prefill``) on the tiny models, with the settings folder in a temporary
models directory."""

from __future__ import annotations

import orjson
import pytest

from core.llama.model import Model
from core.models import prefill_settings
from tests.support import engine_config


@pytest.fixture()
def models_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECGATE_MODELS_DIR", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def speculator(tiny_speculator):
    model = Model(str(tiny_speculator))
    yield model
    model.close()


def store(model: Model, flash_attn: bool, cpu: str | None = None) -> None:
    prefill_settings.save(model, 64, [prefill_settings.Measured(flash_attn, 2.0),
                                      prefill_settings.Measured(not flash_attn, 1.0)])
    if cpu is not None:
        path = prefill_settings.settings_path(model)
        path.write_bytes(orjson.dumps({**orjson.loads(path.read_bytes()), "cpu": cpu}))


def test_measure_times_both_settings_and_the_faster_is_stored(models_dir, speculator):
    tokens = speculator.tokenize("The harbor office reviewed the ledgers before the festival. " * 30)[:256]
    measured = prefill_settings.measure(speculator, tokens, n_threads=2, n_ubatch=128)
    assert [m.flash_attn for m in measured] == [True, False] and all(m.tokens_per_s > 0 for m in measured)
    path = prefill_settings.save(speculator, len(tokens), measured)
    assert path.parent == models_dir / "prefill_settings"
    best = max(measured, key=lambda m: m.tokens_per_s).flash_attn
    assert prefill_settings.stored_flash_attn(speculator) is best
    assert prefill_settings.resolve("auto", speculator) is best
    assert prefill_settings.resolve("on", speculator) is True and prefill_settings.resolve("off", speculator) is False


def test_auto_without_a_measurement_or_from_another_cpu_is_flash_on(models_dir, speculator):
    assert prefill_settings.stored_flash_attn(speculator) is None
    assert prefill_settings.resolve("auto", speculator) is True
    assert prefill_settings.scoring_capture("auto", speculator) == "flash"
    store(speculator, False, cpu="some other CPU x64")
    assert prefill_settings.stored_flash_attn(speculator) is None  # measured elsewhere: not trusted here
    store(speculator, False)
    assert prefill_settings.scoring_capture("auto", speculator) == "softmax"
    assert prefill_settings.scoring_capture("flash", speculator) == "flash"  # an explicit choice wins


def test_the_engine_starts_with_what_was_measured(models_dir, tiny_target, tiny_speculator):
    from core.engine import Engine

    for path, flash_attn in ((tiny_target, False), (tiny_speculator, False)):
        model = Model(str(path))
        store(model, flash_attn)
        model.close()
    engine = Engine(engine_config(tiny_target, tiny_speculator, slots=1))
    try:
        assert engine.target_ctx.flash_attn is False
        assert engine.speculator_ctx.flash_attn is False and type(engine.capture).__name__ == "AttentionCapture"
    finally:
        engine.close()
    engine = Engine(engine_config(tiny_target, tiny_speculator, slots=1, target_flash_attn="on",
                                  attention_capture="flash"))
    try:
        assert engine.target_ctx.flash_attn is True and engine.speculator_ctx.flash_attn is True
    finally:
        engine.close()
