"""The per-turn policies a server sets and a request may override: SpecPrefill
(:class:`PrefillPolicy` with its :class:`Selection` and :class:`Scorer`), decoding
(:class:`DecodingPolicy`) and sampling (:class:`SamplingParams`), together a
:class:`TurnParams`.  What a request may change, and within which bounds, is
declared on the fields (:func:`per_request`); the gateway's parser reads it."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field
from typing import Any

from core.constraints import Constraint
from core.errors import ConfigError
from core.loader import flat_fields
from core.loader import one_of as _one_of
from core.loader import require as _require

SELECT_MODES = ("mass", "chunk")
POSITION_MODES = ("original", "compact")
EVICT_ORDERS = ("scored", "oldest")
GUARD_MODES = ("structural", "skip")
SCORE_AGGREGATIONS = ("max", "filter-sum", "filter-max")  # see core/specprefill/scoring.py
DEFAULT_GUARD_KEYWORDS = (
    '"function"', '"tool"', "function", "tool_call", "<tools>", "get_", "set_",
    "search_", "create_", "update_", "delete_", "list_", "run_",
)


def per_request(default: Any, lo: Any = None, hi: Any = None) -> Any:
    """A policy field a request may set, within ``[lo, hi]`` (a str field: ``lo`` is its
    choices); the server's own setting is checked by ``__post_init__`` as usual."""
    return field(default=default, metadata={"per_request": (lo, hi)})


def request_bounds(cls: type) -> dict[str, tuple[type, Any, Any]]:
    """``{name: (type, lo, hi)}`` of the fields of ``cls`` (nested ones flat) a request may set."""
    kinds = {"bool": bool, "int": int, "float": float, "str": str}
    return {f.name: (kinds[str(f.type)], *f.metadata["per_request"]) for f in flat_fields(cls)
            if "per_request" in f.metadata}


class ScorerKind(enum.StrEnum):
    SPECULATOR_FULL = "speculator-full"
    SPECULATOR_Q4_0 = "speculator-q4_0"  # the whole speculator, block weights re-quantized to Q4_0
    SPECULATOR_EARLY = "speculator-early"
    TARGET_EARLY = "target-early"


_SCORER = re.compile(r"^(speculator-full|speculator-q4_0)$|^(speculator-early|target-early):([1-9][0-9]*)$")


@dataclass(slots=True, frozen=True)
class Scorer:
    """Which model scores prompts (``EngineConfig.scorer``; the files: core.models.scorer_cuts)."""

    kind: ScorerKind = ScorerKind.SPECULATOR_Q4_0
    blocks: int = 0  # the early scorers' R: the first R transformer blocks

    @classmethod
    def parse(cls, text: str) -> Scorer:
        m = _SCORER.match(text)
        if not m:
            raise ConfigError(f"scorer must be speculator-full, speculator-q4_0, speculator-early:R or "
                              f"target-early:R (R blocks, e.g. target-early:9), got {text!r}")
        return cls(ScorerKind(m.group(1))) if m.group(1) else cls(ScorerKind(m.group(2)), int(m.group(3)))

    @property
    def drafts(self) -> bool:
        """Whether the scoring model is a whole speculator (as fetched or its Q4_0 copy), which
        speculative decoding can draft with; an early-layer cut cannot."""
        return self.kind in (ScorerKind.SPECULATOR_FULL, ScorerKind.SPECULATOR_Q4_0)


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
    # a kept token keeps its whole line; a kept def/class line keeps its block (core/specprefill/lines.py).
    # On by default: whole lines, the skeleton and named lines, as `specgate eval --depth` chose
    # (results/depth.md "What SpecPrefill keeps at depth")
    whole_lines: bool = per_request(True)
    code_blocks: bool = per_request(False)
    code_skeleton: bool = per_request(True)  # source code: top-level and def lines kept whatever their scores
    named_lines: bool = per_request(True)  # lines naming what the request names, and named defs' blocks
    # source code with a named block: of the file, only the skeleton and the named lines and blocks stay
    # (off: measured no gain on a fresh seed, results/depth.md "What surrounds a named block")
    named_focus: bool = per_request(False)
    max_line_tokens: int = per_request(96, 0, 65536)  # longer lines (one-line JSON, prose) are not widened
    # earlier turns' dropped tokens on lines the request names, prefilled back before this turn's
    # (core.kv.recall): a follow-up asks for code an earlier turn's selection left out
    max_recall_tokens: int = per_request(512, 0, 65536)

    def __post_init__(self) -> None:
        _require(self.chunk_size >= 1, f"chunk_size must be >= 1, got {self.chunk_size}")
        _one_of("select_mode", self.select_mode, SELECT_MODES)
        _require(0.0 < self.mass <= 1.0, f"mass must be in (0, 1], got {self.mass}")
        _require(0.0 < self.keep_fraction <= 1.0, f"keep_fraction must be in (0, 1], got {self.keep_fraction}")
        _require(self.keep_first >= 0 and self.keep_last >= 1, "keep_first must be >= 0 and keep_last >= 1")
        _require(self.max_keep >= 0, f"max_keep must be >= 0, got {self.max_keep}")
        _require(self.max_line_tokens >= 0, f"max_line_tokens must be >= 0, got {self.max_line_tokens}")
        _require(self.max_recall_tokens >= 0, f"max_recall_tokens must be >= 0, got {self.max_recall_tokens}")


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
    bridge: bool = True  # original mode: prefill gaps cheaper than one more run (by measured costs)
    safety: float = 1.2
    guard_mode: str = per_request("structural", GUARD_MODES)  # see core/specprefill/guard.py, docs/specprefill.md
    guard_scan_tokens: int = 256  # a raw prompt's head that the keyword scan reads
    guard_header_tokens: int = 32  # leading tokens of each tool result kept dense
    guard_user_tokens: int = 256  # trailing tokens of the latest user message kept dense
    guard_keywords: tuple[str, ...] = DEFAULT_GUARD_KEYWORDS
    # a turn that runs densely while its scorer would lag this many tokens or more (an agent's first
    # turn: the tool guard keeps it whole) prefills the scorer too, through the scoring window, so the
    # tool turns after it score only their own tokens (0: never; the scorer catches up in idle time)
    scorer_ahead_tokens: int = 4096
    # past the window, what a session drops first (core/kv/eviction.py): its lowest-scored chunks, or
    # (oldest) its oldest tool results and replies, as llama-server's context shift does
    evict_order: str = per_request("scored", EVICT_ORDERS)
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
        _require(self.scorer_ahead_tokens >= 0, f"scorer_ahead_tokens must be >= 0, got {self.scorer_ahead_tokens}")
        _one_of("evict_order", self.evict_order, EVICT_ORDERS)


class DecodeMode(enum.StrEnum):
    PLAIN = "plain"
    SPECULATIVE = "speculative"  # the speculator drafts, the target verifies densely
    SPECATTN = "specattn"  # speculative, verified through SpecAttn's sparse KV view
    LOOKUP = "lookup"  # drafts copied from the context (prompt lookup), verified by the target


@dataclass(slots=True, frozen=True)
class DecodingPolicy:
    """How one turn decodes after the prefill."""

    speculative: bool = False
    specattn: bool = False  # implies speculative
    lookup: bool = False  # prompt-lookup drafts (core.decoding.lookup); speculative and specattn win over it
    gamma: int = 4
    specattn_p: float = 0.95
    # turns that ask for no mode take the one measured fastest at their depth (core.decoding.mode_speeds)
    decode_auto: bool = False

    def __post_init__(self) -> None:
        _require(1 <= self.gamma <= 16, f"gamma must be in [1, 16], got {self.gamma}")
        _require(0.0 < self.specattn_p <= 1.0, f"specattn_p must be in (0, 1], got {self.specattn_p}")

    @property
    def mode(self) -> DecodeMode:
        if self.specattn:
            return DecodeMode.SPECATTN
        if self.speculative:
            return DecodeMode.SPECULATIVE
        return DecodeMode.LOOKUP if self.lookup else DecodeMode.PLAIN


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """Per-request decoding parameters (OpenAI names where they exist)."""

    max_tokens: int = 256
    max_tokens_asked: int = 0  # what the client asked for, when that was more than max_tokens (0: not clamped)
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop: tuple[str, ...] = ()
    constraint: Constraint | None = None  # forced calls or a JSON reply (core.constraints)

    def __post_init__(self) -> None:
        _require(self.max_tokens >= 1, f"max_tokens must be >= 1, got {self.max_tokens}")
        _require(0.0 <= self.temperature <= 5.0, f"temperature must be in [0, 5], got {self.temperature}")
        _require(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _require(self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}")
        _require(len(self.stop) <= 8 and all(isinstance(s, str) and s for s in self.stop),
                 "stop must be at most 8 non-empty strings")


@dataclass(slots=True, frozen=True)
class TurnParams:
    """Everything a request decides about one turn, besides its messages."""

    prefill: PrefillPolicy = field(default_factory=PrefillPolicy)
    decoding: DecodingPolicy = field(default_factory=DecodingPolicy)
    sampling: SamplingParams = field(default_factory=SamplingParams)
