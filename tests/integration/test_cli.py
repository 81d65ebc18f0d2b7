"""The console script, run as a user runs it (a subprocess)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from core.models import model_files

NEEDLE = ("Alpha beta gamma. " * 80) + "The vault code is 7781. " + ("Delta epsilon. " * 80) + "What is the vault code?"


def specgate(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "cli.main", *args], input=stdin,
                          capture_output=True, text=True, timeout=600)


def test_prefill_json_compare(tiny_target, tiny_speculator):
    out = specgate("prefill", "--target", str(tiny_target), "--speculator", str(tiny_speculator),
                   "--min-tokens", "0", "--break-even", "off", "--max-tokens", "4", "--compare", "--json",
                   "--position-mode", "compact", stdin=NEEDLE)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    for key in ("answer", "specprefill", "context_n", "prompt_n", "position_mode", "scoring_ms", "prompt_ms",
                "ttft_ms", "dense_answer", "dense_ttft_ms", "speedup"):
        assert key in doc, key
    assert doc["specprefill"] == "active" and doc["position_mode"] == "compact"
    assert 0 < doc["prompt_n"] < doc["context_n"]
    assert doc["speedup"] == pytest.approx(doc["dense_ttft_ms"] / doc["ttft_ms"], rel=1e-2)


def test_prefill_table_and_chat_json(tiny_target, tiny_speculator, tmp_path):
    chat = tmp_path / "chat.json"
    chat.write_text(json.dumps([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": NEEDLE}]))
    out = specgate("prefill", "-f", str(chat), "--target", str(tiny_target), "--speculator",
                   str(tiny_speculator), "--max-tokens", "2", "--enabled", "false")
    assert out.returncode == 0, out.stderr
    assert "status" in out.stdout and "disabled" in out.stdout and "TTFT" in out.stdout


def test_prefill_env_precedence(tiny_target, tiny_speculator, monkeypatch):
    monkeypatch.setenv("SPECGATE_TARGET", str(tiny_target))
    monkeypatch.setenv("SPECGATE_SPECULATOR", str(tiny_speculator))
    monkeypatch.setenv("SPECGATE_MIN_TOKENS", "100000")
    out = specgate("prefill", "--max-tokens", "2", "--json", stdin=NEEDLE)
    assert json.loads(out.stdout)["specprefill"] == "skipped_min_tokens"
    out = specgate("prefill", "--max-tokens", "2", "--json", "--min-tokens", "0", "--break-even", "0", "--bridge", "0",
                   stdin=NEEDLE)
    assert json.loads(out.stdout)["specprefill"] == "active"


def test_clear_errors(tmp_path, tiny_target):
    out = specgate("prefill", "--target", str(tmp_path / "missing.gguf"), "--speculator", str(tiny_target),
                   "hello")
    assert out.returncode == 2 and "model file not found" in out.stderr
    out = specgate("prefill", "--target", str(tiny_target), "--speculator", str(tiny_target),
                   "--mass", "3", "hello")
    assert out.returncode == 2 and "mass must be in (0, 1]" in out.stderr
    out = specgate("prefill", "--target", str(tiny_target), "--speculator", str(tiny_target),
                   "--n-ctx", "256", "--no-template", "word " * 400)
    assert out.returncode == 2  # a raw prompt past the window: eviction may drop none of it
    assert "must keep, with its reply, has" in out.stderr and "but the context holds 255" in out.stderr
    out = specgate("prefill", "--target", str(tiny_target), "--speculator", str(tiny_target),
                   "--n-ctx", "256", "--no-template", "word " * 1100)
    assert out.returncode == 2 and "prompt has 1101 tokens but the context holds 1024" in out.stderr  # 4x


def test_fetch_models_is_idempotent_and_verifies(tmp_path):
    out = specgate("fetch-models", model_files.SMALL.name)
    assert out.returncode == 0 and "present and verified" in out.stdout
    bad = tmp_path / model_files.SMALL.filename
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    assert not model_files.is_verified(model_files.SMALL, bad)
    out = specgate("fetch-models", "no-such-model")
    assert out.returncode == 2 and "unknown model" in out.stderr


def test_calibrate_writes_a_monotone_map_the_engine_loads(tiny_target, tiny_speculator, tmp_path):
    from core.config import EngineConfig
    from core.decoding import layer_map
    from core.engine import Engine
    from core.errors import ConfigError
    from core.llama.model import Model
    from core.models.scorer_cuts import requantized

    out_path = tmp_path / "map.json"
    doc_path = tmp_path / "doc.txt"
    doc_path.write_text(NEEDLE)
    out = specgate("calibrate", "--target", str(tiny_target), "--speculator", str(tiny_speculator),
                   "--texts", str(doc_path), "--tokens", "160", "--queries", "4", "--out", str(out_path))
    assert out.returncode == 0, out.stderr
    doc = json.loads(out_path.read_text())
    assert len(doc["map"]) == 3 and doc["map"] == sorted(doc["map"]) and set(doc["map"]) <= {0, 1}
    assert doc["target_sha256"] == model_files.sha256_of(tiny_target)
    # keyed by the file the engine scores with: by default the speculator's Q4_0 copy
    assert doc["speculator_sha256"] == model_files.sha256_of(requantized(tiny_speculator))
    sim = doc["similarity"]
    assert len(sim) == 2 and len(sim[0]) == 3 and all(v <= 1e-6 for row in sim for v in row)  # -KL <= 0
    engine = Engine(EngineConfig(target=str(tiny_target), speculator=str(tiny_speculator), n_ctx=256,
                                 n_threads=2, calibrate_tokens=0, layer_map=str(out_path)))
    try:
        assert engine.layer_map.source == "calibrated" and list(engine.layer_map.mapping) == doc["map"]
    finally:
        engine.close()
    t, s = Model(str(tiny_speculator)), Model(str(tiny_target))  # the reversed pair must be refused
    try:
        with pytest.raises(ConfigError, match="other model files"):
            layer_map.load(t, s, str(out_path))
    finally:
        t.close()
        s.close()
