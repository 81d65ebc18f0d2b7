"""Flash attention on or off, per model, chosen by measuring prefill on this machine.

Which is faster depends on the model, the context length and the CPU (measured here:
the 1.5B target prefilled faster with it off at long context on one machine; the 0.5B
speculator 4% faster with it on on another), and llama.cpp fixes it when a context is
created.  ``specgate calibrate --prefill N`` times both settings on N tokens and stores
the faster per model file and CPU; the engine reads it at start-up when the setting is
``auto``.  A file measured on another CPU is ignored."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import orjson

from core.errors import ConfigError
from core.llama.context import Context
from core.llama.model import Model
from core.machine import cpu_name
from core.models.model_files import cached_sha256, models_dir


@dataclass(slots=True, frozen=True)
class Measured:
    flash_attn: bool
    tokens_per_s: float


def settings_path(model: Model) -> Path:
    return models_dir() / "prefill_settings" / f"{cached_sha256(model.path)[:16]}.json"


def measure(model: Model, tokens: Sequence[int], n_threads: int, n_ubatch: int) -> list[Measured]:
    """Prefill ``tokens`` with flash attention on, then off (one fresh context each)."""
    out = []
    for flash_attn in (True, False):
        ctx = Context(model, n_ctx=len(tokens) + 64, n_batch=max(512, n_ubatch), n_ubatch=n_ubatch,
                      n_threads=n_threads, flash_attn=flash_attn)
        try:
            ctx.decode(tokens[:32], 0)  # pages the weights in; the timed prefill follows it
            t0 = time.perf_counter()
            ctx.decode(tokens, 32, logits_last=False)
            out.append(Measured(flash_attn, len(tokens) / (time.perf_counter() - t0)))
        finally:
            ctx.close()
    return out


def save(model: Model, n_tokens: int, measured: list[Measured]) -> Path:
    best = max(measured, key=lambda m: m.tokens_per_s)
    path = settings_path(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"model_sha256": cached_sha256(model.path), "cpu": cpu_name(), "tokens": n_tokens,
           "measured": [{"flash_attn": m.flash_attn, "tokens_per_s": round(m.tokens_per_s, 2)} for m in measured],
           "flash_attn": best.flash_attn}
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return path


def stored_flash_attn(model: Model) -> bool | None:
    """The measured choice for this model file on this CPU; None when none was stored."""
    path = settings_path(model)
    if not path.is_file():
        return None
    try:
        doc = orjson.loads(path.read_bytes())
        if doc["model_sha256"] != cached_sha256(model.path) or doc["cpu"] != cpu_name():
            return None
        return bool(doc["flash_attn"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"unreadable prefill settings {path}: {exc}") from exc


def resolve(setting: str, model: Model) -> bool:
    """``on``/``off`` as given; ``auto``: what was measured for this model here, else on."""
    if setting == "auto":
        stored = stored_flash_attn(model)
        return True if stored is None else stored
    return setting == "on"


def scoring_capture(kind: str, model: Model) -> str:
    """EngineConfig.attention_capture made concrete: ``auto`` is ``flash`` unless this
    machine measured ``model`` faster without flash attention (then ``softmax``, whose
    context runs without it)."""
    if kind != "auto":
        return kind
    return "softmax" if stored_flash_attn(model) is False else "flash"
