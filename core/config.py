"""Configuration dataclasses and the one place they are built from flags and env.

Precedence, highest first: an explicit CLI flag (or request field), then the
``SPECGATE_<FIELD>`` environment variable (field name upper-cased, e.g.
``SPECGATE_MASS=0.9``, ``SPECGATE_TARGET=/m/t.gguf``), then the default below.
"""

from __future__ import annotations

import dataclasses
import enum
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

from core.decoding.constraints import Constraint
from core.errors import ConfigError

SELECT_MODES = ("mass", "chunk")
POSITION_MODES = ("original", "compact")
GUARD_MODES = ("structural", "skip")
SCORE_AGGREGATIONS = ("max", "filter-sum", "filter-max")  # see core/specprefill/scoring.py
KV_LAYOUTS = ("split", "unified")  # see core/llama_bindings.Context
DEFAULT_GUARD_KEYWORDS = (
    '"function"', '"tool"', "function", "tool_call", "<tools>", "get_", "set_",
    "search_", "create_", "update_", "delete_", "list_", "run_",
)


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _one_of(name: str, value: str, choices: tuple[str, ...]) -> None:
    _require(value in choices, f"{name} must be one of {choices}, got {value!r}")


def per_request(default: Any, lo: Any = None, hi: Any = None) -> Any:
    """A policy field a request may set, within ``[lo, hi]`` (a str field: ``lo`` is its
    choices); the server's own setting is checked by ``__post_init__`` as usual."""
    return field(default=default, metadata={"per_request": (lo, hi)})


def request_bounds(cls: type) -> dict[str, tuple[type, Any, Any]]:
    """``{name: (type, lo, hi)}`` of the fields of ``cls`` (nested ones flat) a request may set."""
    kinds = {"bool": bool, "int": int, "float": float, "str": str}
    return {f.name: (kinds[str(f.type)], *f.metadata["per_request"]) for f in flat_fields(cls)
            if "per_request" in f.metadata}


def field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


class ScorerKind(enum.StrEnum):
    SPECULATOR_FULL = "speculator-full"
    SPECULATOR_EARLY = "speculator-early"
    TARGET_EARLY = "target-early"


_SCORER = re.compile(r"^(speculator-full)$|^(speculator-early|target-early):([1-9][0-9]*)$")


@dataclass(slots=True, frozen=True)
class Scorer:
    """Which model scores prompts (``EngineConfig.scorer``; the files: core.llama.scorer_cuts)."""

    kind: ScorerKind = ScorerKind.SPECULATOR_FULL
    blocks: int = 0  # the early scorers' R: the first R transformer blocks

    @classmethod
    def parse(cls, text: str) -> Scorer:
        m = _SCORER.match(text)
        if not m:
            raise ConfigError(f"scorer must be speculator-full, speculator-early:R or target-early:R "
                              f"(R blocks, e.g. target-early:9), got {text!r}")
        return cls() if m.group(1) else cls(ScorerKind(m.group(2)), int(m.group(3)))

    @property
    def drafts(self) -> bool:
        """Whether the scoring model is the whole speculator, which speculative decoding drafts with."""
        return self.kind is ScorerKind.SPECULATOR_FULL


@dataclass(slots=True, frozen=True)
class Selection:
    """Which chunks of the scored tokens the target prefills (core.specprefill.selection)."""

    chunk_size: int = per_request(32, 8, 512)
    select_mode: str = per_request("mass", SELECT_MODES)
    mass: float = per_request(0.85, 0.05, 1.0)
    keep_fraction: float = per_request(0.3, 0.01, 1.0)
    keep_first: int = 4
    keep_last: int = 2
    max_keep: int = 0  # 0 = no cap

    def __post_init__(self) -> None:
        _require(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _one_of("select_mode", self.select_mode, SELECT_MODES)
        _require(0.0 < self.mass <= 1.0, f"mass must be in (0, 1], got {self.mass}")
        _require(0.0 < self.keep_fraction <= 1.0, f"keep_fraction must be in (0, 1], got {self.keep_fraction}")
        _require(self.keep_first >= 0 and self.keep_last >= 1, "keep_first must be >= 0 and keep_last >= 1")
        _require(self.max_keep >= 0, f"max_keep must be >= 0, got {self.max_keep}")


@dataclass(slots=True, frozen=True)
class PrefillPolicy:
    """SpecPrefill for one turn: scoring, selection, guard and break-even."""

    enabled: bool = per_request(True)
    lookahead: int = per_request(1, 0, 16)  # chosen by specgate eval: see results/scorers.md "Answer quality"
    pool_kernel: int = 13
    score_agg: str = "max"  # rows to scores (core/specprefill/scoring.py); filter-* read the last layer
    boost_first_n: int = 64
    boost_first_mult: float = 1.5
    boost_last_n: int = 128
    boost_last_mult: float = 1.3
    position_mode: str = per_request("original", POSITION_MODES)
    min_tokens: int = 1024
    break_even: bool = True
    safety: float = 1.2
    guard_mode: str = per_request("structural", GUARD_MODES)  # see core/specprefill/guard.py, docs/specprefill.md
    guard_scan_tokens: int = 256  # a raw prompt's head that the keyword scan reads
    guard_header_tokens: int = 32  # leading tokens of each tool result kept dense
    guard_user_tokens: int = 256  # trailing tokens of the latest user message kept dense
    guard_keywords: tuple[str, ...] = DEFAULT_GUARD_KEYWORDS
    selection: Selection = field(default_factory=Selection)

    def __post_init__(self) -> None:
        _require(self.lookahead >= 0, f"lookahead must be >= 0, got {self.lookahead}")
        _require(self.pool_kernel >= 0, f"pool_kernel must be >= 0, got {self.pool_kernel}")
        _require(self.boost_first_mult > 0 and self.boost_last_mult > 0, "boost multipliers must be > 0")
        _require(self.boost_first_n >= 0 and self.boost_last_n >= 0, "boost spans must be >= 0")
        _one_of("position_mode", self.position_mode, POSITION_MODES)
        _one_of("score_agg", self.score_agg, SCORE_AGGREGATIONS)
        _require(self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}")
        _require(self.safety > 0, f"safety must be > 0, got {self.safety}")
        _one_of("guard_mode", self.guard_mode, GUARD_MODES)
        _require(self.guard_scan_tokens >= 0, "guard_scan_tokens must be >= 0")
        _require(self.guard_header_tokens >= 0 and self.guard_user_tokens >= 0,
                 "guard_header_tokens and guard_user_tokens must be >= 0")


class DecodeMode(enum.StrEnum):
    PLAIN = "plain"
    SPECULATIVE = "speculative"  # the speculator drafts, the target verifies densely
    SPECATTN = "specattn"  # speculative, verified through SpecAttn's sparse KV view


@dataclass(slots=True, frozen=True)
class DecodingPolicy:
    """How one turn decodes after the prefill."""

    speculative: bool = False
    specattn: bool = False  # implies speculative
    gamma: int = 4
    specattn_p: float = 0.95

    def __post_init__(self) -> None:
        _require(1 <= self.gamma <= 16, f"gamma must be in [1, 16], got {self.gamma}")
        _require(0.0 < self.specattn_p <= 1.0, f"specattn_p must be in (0, 1], got {self.specattn_p}")

    @property
    def mode(self) -> DecodeMode:
        if self.specattn:
            return DecodeMode.SPECATTN
        return DecodeMode.SPECULATIVE if self.speculative else DecodeMode.PLAIN


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Model files and llama.cpp context settings."""

    target: str = ""
    speculator: str = ""
    n_ctx: int = 8192
    speculator_n_ctx: int = 0  # 0 = same as n_ctx
    n_threads: int = field(default_factory=lambda: os.cpu_count() or 1)
    n_batch: int = 512
    n_ubatch: int = 512
    target_flash_attn: bool = True
    calibrate_tokens: int = 128
    layer_map: str = ""  # SpecAttn layer map JSON; empty = the one `specgate calibrate` stored for this pair
    slots: int = 4  # sessions resident at once in both contexts (each up to n_ctx tokens); 1 = one turn at a time
    kv_layout: str = "split"  # split: a KV stream per slot; unified: one shared pool (needed for SpecAttn)
    step_tokens: int = 256  # the most prefill tokens a step carries while other turns stream; 0 = decode first
    prefill_share: float = 0.5  # such a chunk costs at most this share of the rest of its step; 0 = always
    # step_tokens (core/runtime/chunk_budget.py, README "Many sessions at once")
    scorer: str = "speculator-full"  # the model that scores prompts (core/llama/scorer_cuts.py): or speculator-early:R,
    # target-early:R -- the first R blocks of either model (README "A cheaper scorer")

    def __post_init__(self) -> None:
        _require(self.n_ctx >= 64, f"n_ctx must be >= 64, got {self.n_ctx}")
        _require(1 <= self.slots <= 64, f"slots must be in [1, 64], got {self.slots}")
        _one_of("kv_layout", self.kv_layout, KV_LAYOUTS)
        _require(self.step_tokens >= 0, f"step_tokens must be >= 0, got {self.step_tokens}")
        _require(self.prefill_share >= 0, f"prefill_share must be >= 0, got {self.prefill_share}")
        _require(self.slots < self.n_batch, f"n_batch ({self.n_batch}) must exceed slots ({self.slots})")
        _require(self.speculator_n_ctx >= 0, f"speculator_n_ctx must be >= 0, got {self.speculator_n_ctx}")
        _require(self.n_threads >= 1, f"n_threads must be >= 1, got {self.n_threads}")
        _require(1 <= self.n_ubatch <= self.n_batch, "need 1 <= n_ubatch <= n_batch")
        _require(self.calibrate_tokens >= 0, "calibrate_tokens must be >= 0")
        Scorer.parse(self.scorer)

    @property
    def scorer_drafts(self) -> bool:
        """Whether the scoring model is the whole speculator (speculative decoding drafts with it)."""
        return Scorer.parse(self.scorer).drafts

    @property
    def speculator_ctx_len(self) -> int:
        return self.speculator_n_ctx or self.n_ctx


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI names where they exist)."""

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # forced calls or a JSON reply (core.decoding.constraints)

    def __post_init__(self) -> None:
        _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(0.0 <= self.temperature <= 5.0, f"temperature must be in [0, 5], got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _require(len(self.stop) <= 8 and all(isinstance(s, str) and s for s in self.stop),
                 "stop must be at most 8 non-empty strings")


@dataclass(slots=True, frozen=True)
class Limits:
    """What one client may ask of the server; over a limit is a 400 or 413 naming it."""

    max_messages: int = 2048
    max_prompt_chars: int = 0  # characters of content before templating; 0 = 16 per context token
    max_tool_depth: int = 16  # JSON nesting of the tool definitions
    max_tokens_cap: int = 4096  # the largest max_tokens a request may ask for
    max_sessions: int = 4096  # live sessions in this process
    max_sessions_per_key: int = 512

    def __post_init__(self) -> None:
        for name in ("max_messages", "max_tool_depth", "max_tokens_cap", "max_sessions", "max_sessions_per_key"):
            _require(getattr(self, name) >= 1, f"{name} must be >= 1")
        _require(self.max_prompt_chars >= 0, "max_prompt_chars must be >= 0")


DEFAULT_LIMITS = Limits()


@dataclass(slots=True, frozen=True)
class GatewayConfig:
    """The HTTP server, sessions and the metadata store."""

    host: str = "127.0.0.1"
    port: int = 8080
    model_name: str = "specgate"
    redis_url: str = ""  # empty = the in-process store
    session_ttl_s: int = 86400
    auto_create_sessions: bool = True  # an unknown X-Session-Id on a chat request creates the session
    kv_budget_mb: int = 2048
    prefix_min_tokens: int = 256  # a system prompt this long is cached for new sessions (0 = no prefix cache)
    implicit_sessions: bool = True  # a request naming no session continues the held conversation its tokens match
    implicit_min_share: float = 0.5  # ... when the match covers at least this share of its prompt
    kv_spill_dir: str = ""
    max_queue: int = 64
    max_body_mb: int = 16
    log_level: str = "info"
    api_keys: tuple[str, ...] = ()  # SPECGATE_API_KEYS=k1,k2; none (and no file) = no authentication
    api_keys_file: str = ""  # one key per line, '#' comments
    kv_spill_max_mb: int = 8192  # disk the spilled KV may take; past it the oldest spills are dropped
    drain_timeout_s: float = 30.0  # SIGTERM: how long running turns may take to finish
    replica_id: str = ""  # this replica's name in the session registry; empty = hostname-port
    advertise_url: str = ""  # where other replicas reach this one; empty = http://host:port
    lease_ms: int = 15000  # a session lease's TTL in Redis, renewed while the replica keeps the session
    limits: Limits = field(default_factory=Limits)

    def __post_init__(self) -> None:
        _require(0 <= self.port <= 65535, f"port must be in [0, 65535], got {self.port}")
        _require(self.session_ttl_s >= 1, "session_ttl_s must be >= 1")
        _require(self.kv_budget_mb >= 0, "kv_budget_mb must be >= 0")
        _require(self.prefix_min_tokens >= 0, "prefix_min_tokens must be >= 0")
        _require(0.0 < self.implicit_min_share <= 1.0, "implicit_min_share must be in (0, 1]")
        _require(self.max_queue >= 1, "max_queue must be >= 1")
        _require(self.max_body_mb >= 1, "max_body_mb must be >= 1")
        _one_of("log_level", self.log_level, ("debug", "info", "warning", "error"))
        _require(self.kv_spill_max_mb >= 0, "kv_spill_max_mb must be >= 0")
        _require(self.drain_timeout_s >= 0, "drain_timeout_s must be >= 0")
        _require(self.lease_ms >= 1000, "lease_ms must be >= 1000")


@dataclass(slots=True, frozen=True)
class TurnParams:
    """Everything a request decides about one turn, besides its messages."""

    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    decoding: DecodingPolicy = field(default_factory=DecodingPolicy)
    sampling: SamplingParams = field(default_factory=SamplingParams)


@dataclass(slots=True, frozen=True)
class ServeConfig:
    """``specgate serve``: the gateway, the engine, and the default turn policies."""

    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    decoding: DecodingPolicy = field(default_factory=DecodingPolicy)

    def __post_init__(self) -> None:
        _require(self.decoding.mode is DecodeMode.PLAIN or self.engine.scorer_drafts,
                 f"speculative decoding drafts with the whole speculator, but --scorer is {self.engine.scorer}")


T = TypeVar("T")


def parse_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def _convert(name: str, raw: Any, default: Any) -> Any:
    if isinstance(raw, str) and not isinstance(default, str):
        try:
            if isinstance(default, bool):
                return parse_bool(raw)
            if isinstance(default, int):
                return int(raw)
            if isinstance(default, float):
                return float(raw)
            if isinstance(default, tuple):
                return tuple(s for s in raw.split(",") if s)
        except ValueError:
            raise ConfigError(f"{name}: cannot read {raw!r} as {type(default).__name__}") from None
    return raw


def flat_fields(cls: type) -> list[dataclasses.Field]:
    """The settable fields of ``cls``, with nested config dataclasses expanded: flags,
    ``SPECGATE_*`` variables and request objects name them flat (``mass``, not
    ``selection.mass``); field names are unique across the nesting."""
    out: list[dataclasses.Field] = []
    for f in dataclasses.fields(cls):
        default = field_default(f)
        out.extend(flat_fields(type(default)) if dataclasses.is_dataclass(default) else [f])
    return out


def build(cls: type[T], flags: Mapping[str, Any] | None = None,
          env: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from flags (non-None wins), then SPECGATE_* env, then defaults."""
    flags = flags or {}
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        default = field_default(f)
        if dataclasses.is_dataclass(default):
            values[f.name] = build(type(default), flags, env)
        elif flags.get(f.name) is not None:
            values[f.name] = _convert(f"--{f.name.replace('_', '-')}", flags[f.name], default)
        elif (key := f"SPECGATE_{f.name.upper()}") in env:
            values[f.name] = _convert(key, env[key], default)
    return cls(**values)


def override(base: T, **changes: Any) -> T:
    """A copy of ``base`` with the non-None ``changes`` (flat names, see :func:`flat_fields`)
    applied and validated; an unknown name is a :class:`ConfigError`."""
    real = {k: v for k, v in changes.items() if v is not None}
    if not real:
        return base
    for f in dataclasses.fields(base):  # type: ignore[arg-type]
        inner = getattr(base, f.name)
        if dataclasses.is_dataclass(inner):
            names = {g.name for g in flat_fields(type(inner))}
            mine = {k: real.pop(k) for k in list(real) if k in names}
            if mine:
                real[f.name] = override(inner, **mine)
    known = {f.name for f in dataclasses.fields(base)}  # type: ignore[arg-type]
    if unknown := set(real) - known:
        raise ConfigError(f"unknown field(s) {sorted(unknown)} for {type(base).__name__}")
    return dataclasses.replace(base, **real)  # type: ignore[type-var]
