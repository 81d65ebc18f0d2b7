"""The engine's configuration (models, contexts, slots, threads) and the limits on what
one client may ask; the per-turn policies are in :mod:`core.policies`, the gateway's
and ``specgate serve``'s configs in :mod:`gateway.serve_config`, and how any of them
is built from flags and ``SPECGATE_*`` variables in :mod:`core.loader`."""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from core.errors import ConfigError
from core.loader import one_of as _one_of
from core.loader import require as _require
from core.policies import Scorer

KV_LAYOUTS = ("split", "unified")  # see core/llama/context.py
CAPTURES = ("auto", "flash", "softmax")  # see core/llama/capture.py
FLASH_ATTN = ("auto", "on", "off")  # see core/models/prefill_settings.py
KV_CACHE_TYPES = ("f16", "q8_0")  # see core/llama/context.py
KV_ELEMENT_BYTES = {"f16": 2.0, "q8_0": 34 / 32}  # bytes per cached element


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Model files and llama.cpp context settings."""

    target: str = ""
    speculator: str = ""
    n_ctx: int = 0  # 0 = the target's trained context (32768 for the default pair; see with_default_models)
    speculator_n_ctx: int = 0  # 0 = same as n_ctx
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    n_batch: int = 512
    n_ubatch: int = 512
    target_flash_attn: str = "auto"  # on, off, or auto: as `specgate calibrate --prefill` measured it here, else on
    attention_capture: str = "auto"  # how scoring reads attention (core/llama/capture.py): flash runs the
    # scoring model with flash attention and recomputes the rows; softmax reads kq_soft_max with it off;
    # auto: flash unless `specgate calibrate --prefill` measured the scoring model faster without it
    kv_type: str = "f16"  # both models' KV cache: q8_0 holds ~half the bytes, needs flash attention in both
    # (--target-flash-attn on, --attention-capture flash), and prefilled 2.8x slower on the Xeon-AMX CPU
    calibrate_tokens: int = 128
    layer_map: str = ""  # SpecAttn layer map JSON; empty = the one `specgate calibrate` stored for this pair
    slots: int = 4  # sessions resident at once in both contexts (each up to n_ctx tokens); 1 = one turn at a time
    kv_layout: str = "split"  # split: a KV stream per slot; unified: one shared pool (needed for SpecAttn)
    step_tokens: int = 256  # the most prefill tokens a step carries while other turns stream; 0 = decode first
    prefill_share: float = 0.5  # such a chunk costs at most this share of the rest of its step; 0 = always
    # step_tokens (core/runtime/chunk_budget.py, README "Many sessions at once")
    progress_log_s: float = 10.0  # a long prefill logs its progress (tokens done, rate, time left) this often
    scoring_window: int = 2048  # the scoring model prefills long prompts with each token attending to the first
    # 64 and the last this many cells (core/kv/scoring_window.py); the scored rows still see all; 0 = off
    max_context_tokens: int = 0  # the longest prompt a turn may send (logical tokens); 0 = 4x the window.
    # Past the window a session drops its least important cells (core/kv/eviction.py); past this, a 400
    recent_tokens: int = 8192  # eviction keeps a conversation's last this many tokens whole, where it can
    scorer: str = "speculator-q4_0"  # the model that scores prompts (core/models/scorer_cuts.py): the speculator
    # re-quantized to Q4_0 (scored 1.5x faster and kept every answer, results/scorers.md); speculator-full, the
    # file as given; speculator-early:R, target-early:R -- the first R blocks of either model

    def __post_init__(self) -> None:
        _require(self.n_ctx == 0 or self.n_ctx >= 64, f"n_ctx must be 0 (the model's trained context) or >= 64, "
                                                       f"got {self.n_ctx}")
        _require(1 <= self.slots <= 64, f"slots must be in [1, 64], got {self.slots}")
        _one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        _one_of("attention_capture", self.attention_capture, CAPTURES)
        _one_of("target_flash_attn", self.target_flash_attn, FLASH_ATTN)
        _one_of("kv_type", self.kv_type, KV_CACHE_TYPES)
        _require(self.step_tokens >= 0, f"step_tokens must be >= 0, got {self.step_tokens}")
        _require(self.prefill_share >= 0, f"prefill_share must be >= 0, got {self.prefill_share}")
        _require(self.progress_log_s > 0, f"progress_log_s must be > 0, got {self.progress_log_s}")
        _require(self.slots < self.n_batch, f"n_batch ({self.n_batch}) must exceed slots ({self.slots})")
        _require(self.max_context_tokens >= 0, f"max_context_tokens must be >= 0, got {self.max_context_tokens}")
        _require(self.recent_tokens >= 0, f"recent_tokens must be >= 0, got {self.recent_tokens}")
        _require(self.speculator_n_ctx >= 0, f"speculator_n_ctx must be >= 0, got {self.speculator_n_ctx}")
        _require(self.n_threads >= 1, f"n_threads must be >= 1, got {self.n_threads}")
        _require(1 <= self.n_ubatch <= self.n_batch, "need 1 <= n_ubatch <= n_batch")
        _require(self.calibrate_tokens >= 0, "calibrate_tokens must be >= 0")
        _require(self.scoring_window == 0 or self.scoring_window >= 128,
                 f"scoring_window must be 0 (off) or >= 128, got {self.scoring_window}")
        Scorer.parse(self.scorer)

    @property
    def scorer_drafts(self) -> bool:
        """Whether the scoring model is a whole speculator (speculative decoding drafts with it)."""
        return Scorer.parse(self.scorer).drafts

    @property
    def context_limit(self) -> int:
        """The longest prompt a turn may send: ``max_context_tokens``, else 4x the window
        (both models' contexts; a session past it packs its cells)."""
        return self.max_context_tokens or 4 * min(self.n_ctx, self.speculator_ctx_len)

    @property
    def speculator_ctx_len(self) -> int:
        return self.speculator_n_ctx or self.n_ctx


@dataclass(slots=True, frozen=True)
class Limits:
    """What one client may ask of the server; over a limit is a 400 or 413 naming it."""

    max_messages: int = 2048
    max_prompt_chars: int = 0  # characters of content before templating; 0 = 16 per context token
    max_tool_depth: int = 16  # JSON nesting of the tool definitions
    max_tokens_cap: int = 32768  # a request's max_tokens is clamped to this (and to what its context leaves)
    default_max_tokens: int = 4096  # a request that sets no max_tokens
    max_sessions: int = 4096  # live sessions in this process
    max_sessions_per_key: int = 512
    max_stored_response_bytes: int = 1 << 20  # stored Responses bodies per conversation; older ones go first

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_tool_depth", "max_tokens_cap", "default_max_tokens", "max_sessions",
                     "max_sessions_per_key", "max_stored_response_bytes"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        _require(self.max_prompt_chars >= 0, "max_prompt_chars must be >= 0")


DEFAULT_LIMITS = Limits()


def check_kv_type(kv_type: str, target_flash_attn: bool, capture_flash_attn: bool) -> None:
    """A quantized KV cache needs flash attention in both contexts (llama.cpp quantizes V
    only there); say which setting stands in the way."""
    if kv_type == "f16":
        return
    if not target_flash_attn:
        raise ConfigError(f"--kv-type {kv_type} needs flash attention in the target: set --target-flash-attn on "
                          "(auto chose off: `specgate calibrate --prefill` measured it faster here)")
    if not capture_flash_attn:
        raise ConfigError(f"--kv-type {kv_type} needs flash attention in the scoring model: set "
                          "--attention-capture flash")


def kv_cache_bytes(config: EngineConfig, target_per_token: int, speculator_per_token: int) -> int:
    """What both models' KV caches take for ``config.slots`` slots (``*_per_token``: f16 K and
    V of every layer), with the saved state each context keeps for moving labels (one slot's
    worth: core.llama.context.Seq.move), and the windowed scoring prefill's scratch slot and
    the two saved states it keeps between prefills (a slot's, and the slot's with its new
    cells joined)."""
    per_f16 = KV_ELEMENT_BYTES[config.kv_type] / KV_ELEMENT_BYTES["f16"]
    spec_slots = config.slots + 1 + (3 if config.scoring_window else 0)
    return int(per_f16 * ((config.slots + 1) * config.n_ctx * target_per_token
                          + spec_slots * config.speculator_ctx_len * speculator_per_token))
