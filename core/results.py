"""What one turn produces: its text and tokens (:class:`Result`) and its figures
(:class:`Timings`), named as clients read them in ``timings``.

The field names are the wire names (llama.cpp's server where one exists:
``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``), and
:meth:`Timings.to_json` is the one serializer: the HTTP and WebSocket
responses, ``specgate prefill``, the ``turn_done`` log event and the benches
all print what it returns.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.policies import DecodeMode


class Status(enum.StrEnum):
    """What SpecPrefill did with a turn's prompt (the ``specprefill`` timing)."""

    DISABLED = "disabled"
    SKIPPED_MIN_TOKENS = "skipped_min_tokens"
    SKIPPED_TOOL_GUARD = "skipped_tool_guard"
    SKIPPED_BREAK_EVEN = "skipped_break_even"
    KEPT_ALL = "kept_all"
    ACTIVE = "active"


@dataclass(slots=True)
class SpeculativeStats:
    """Speculative decoding over one reply: rounds, drafts, acceptance, KV cells verified."""

    n_rounds: int = 0
    n_drafted: int = 0
    n_accepted: int = 0
    cells_attended: int = 0  # target KV cells the verify batches attended, summed over rounds
    cells_total: int = 0  # cells a dense verify would have attended
    draft_s: float = 0.0
    verify_s: float = 0.0

    @property
    def accept_rate(self) -> float:
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0

    @property
    def selected_frac(self) -> float:
        return self.cells_attended / self.cells_total if self.cells_total else 1.0


def _per_second(n: int, ms: float) -> float | None:
    return round(n / (ms / 1e3), 2) if ms > 0 else None


@dataclass(slots=True)
class Timings:
    specprefill: str = Status.DISABLED.value  # the planner's status
    specprefill_reason: str = ""
    position_mode: str = "original"
    context_n: int = 0  # prompt tokens in the whole context
    cache_n: int = 0  # target tokens reused from the session
    prompt_n: int = 0  # tokens the target prefilled this turn (the kept ones)
    kept_runs: int = 0  # contiguous runs those tokens form
    content_kind: str = ""  # of the tokens free to drop (core.specprefill.content), when the planner looked
    prompt_ms: float = 0.0  # the target's prefill
    bridge_moves: int = 0  # position labels moved between its runs (core.kv.sparse_prefill)
    bridge_ms: float = 0.0  # those moves (part of prompt_ms)
    recalled_n: int = 0  # earlier turns' dropped tokens prefilled back first: lines this request names (core.kv.recall)
    recall_ms: float = 0.0  # that prefill, with taking the later cells out and back (part of the TTFT)
    physical_n: int = 0  # the target's KV positions the prompt takes (below context_n once cells were packed)
    evicted_n: int = 0  # cells this turn gave up (and prompt tokens it never prefilled) to fit the window
    evict_ms: float = 0.0  # choosing them, packing both models' cells and prefilling what stayed (part of the TTFT)
    speculator_cache_n: int = 0  # speculator tokens reused from the session
    speculator_prefill_n: int = 0  # prompt tokens prefilled into the speculator this turn
    speculator_prefill_ms: float = 0.0
    speculator_mirrored_n: int = 0  # of those, the target's cells re-prefilled so the speculator mirrors it
    speculator_deferred_n: int = 0  # context tokens the speculator has yet to catch up on (next scoring turn)
    speculator_windowed_n: int = 0  # of the prefilled, those that attended through the window (core.kv.scoring_window)
    lookahead_ms: float = 0.0
    scoring_ms: float = 0.0  # speculator prefill + lookahead + selection
    ttft_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    kv_rebuilt: bool = False  # the session's KV was dropped and rebuilt from its tokens
    prefix_shared_n: int = 0  # target tokens this session started from a shared prefix (cache or resident session)
    prefix_built_n: int = 0  # system-prompt tokens this turn prefilled into the prefix cache
    prefix_source: str = ""  # where a shared prefix came from: resident, ram, tier, checkpoint, built ("": none)
    prefix_ms: float = 0.0  # copying, restoring or building it (part of the TTFT)
    prefix_bytes: int = 0  # KV bytes read back to restore it (ram, tier, checkpoint)
    prefix_spliced_n: int = 0  # of prefix_shared_n, tokens moved in from where a sibling conversation holds them
    decode_mode: str = DecodeMode.PLAIN.value
    decode_auto: bool = False  # the mode was picked by measured speed at this depth (--decode-auto)
    turn_kind: str = "free"  # copy (after a tool result, or a forced call) or free: decode speeds are kept apart
    constraint: str = ""  # what the reply was held to (core.constraints kinds); "" when free
    grammar_ms: float = 0.0
    mask_ms: float = 0.0
    draft_sync_ms: float = 0.0  # bringing the draft up to the prompt before speculating
    speculative: SpeculativeStats = field(default_factory=SpeculativeStats)
    max_tokens: int = 0  # the reply's ceiling: the request's max_tokens, clamped to the cap and the context left
    max_tokens_asked: int = 0  # what the request asked for, when it was clamped (0: it was not)

    @property
    def new_n(self) -> int:
        """Prompt tokens this turn had to prefill (not reused from the session)."""
        return self.context_n - self.cache_n

    @property
    def kept_pct(self) -> float:
        return 100.0 * self.prompt_n / self.new_n if self.new_n else 0.0

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "specprefill": self.specprefill, "specprefill_reason": self.specprefill_reason,
            "position_mode": self.position_mode, "context_n": self.context_n, "cache_n": self.cache_n,
            "prompt_n": self.prompt_n, "kept_runs": self.kept_runs, "content_kind": self.content_kind,
            "prompt_ms": round(self.prompt_ms, 2),
            "prompt_per_second": _per_second(self.prompt_n, self.prompt_ms),
            "speculator_cache_n": self.speculator_cache_n, "speculator_prefill_n": self.speculator_prefill_n,
            "speculator_prefill_ms": round(self.speculator_prefill_ms, 2),
            "speculator_mirrored_n": self.speculator_mirrored_n,
            "speculator_deferred_n": self.speculator_deferred_n,
            "speculator_windowed_n": self.speculator_windowed_n,
            "lookahead_ms": round(self.lookahead_ms, 2), "scoring_ms": round(self.scoring_ms, 2),
            "ttft_ms": round(self.ttft_ms, 2), "predicted_n": self.predicted_n,
            "predicted_ms": round(self.predicted_ms, 2),
            "predicted_per_second": _per_second(self.predicted_n, self.predicted_ms),
            "kv_rebuilt": self.kv_rebuilt, "prefix_shared_n": self.prefix_shared_n,
            "prefix_built_n": self.prefix_built_n, "decode_mode": self.decode_mode, "max_tokens": self.max_tokens,
        }
        if self.decode_auto:
            out.update({"decode_auto": True, "turn_kind": self.turn_kind})
        if self.prefix_source:
            out.update({"prefix_source": self.prefix_source, "prefix_ms": round(self.prefix_ms, 2),
                        "prefix_bytes": self.prefix_bytes, "prefix_spliced_n": self.prefix_spliced_n})
        if self.max_tokens_asked:
            out["max_tokens_asked"] = self.max_tokens_asked
        if self.evicted_n or 0 < self.physical_n != self.context_n:
            out.update({"physical_n": self.physical_n, "evicted_n": self.evicted_n,
                        "evict_ms": round(self.evict_ms, 2)})
        if self.bridge_moves:
            out.update({"bridge_moves": self.bridge_moves, "bridge_ms": round(self.bridge_ms, 2)})
        if self.recalled_n:
            out.update({"recalled_n": self.recalled_n, "recall_ms": round(self.recall_ms, 2)})
        if self.constraint:
            out.update({"constraint": self.constraint, "grammar_ms": round(self.grammar_ms, 2),
                        "mask_ms": round(self.mask_ms, 2)})
        if self.decode_mode != DecodeMode.PLAIN:
            s = self.speculative
            out.update({
                "draft_sync_ms": round(self.draft_sync_ms, 2), "draft_n": s.n_drafted,
                "draft_accepted_n": s.n_accepted, "draft_acceptance": round(s.accept_rate, 4),
                "kv_cells_attended": s.cells_attended, "kv_cells_total": s.cells_total,
                "kv_selected_fraction": round(s.selected_frac, 4),
                "draft_ms": round(s.draft_s * 1e3, 2), "verify_ms": round(s.verify_s * 1e3, 2),
            })
        return out


@dataclass(slots=True)
class PrefixStart:
    """How a session without KV started: tokens restored or adopted, or built for the cache."""

    shared: int = 0
    built: int = 0
    seconds: float = 0.0  # restoring, waiting for or building the prefix (part of the TTFT)
    evicted: list[str] = field(default_factory=list)
    source: str = ""  # resident, ram, tier, checkpoint or built (Timings.prefix_source)
    loaded_bytes: int = 0  # KV bytes read back (RAM or the tier)
    spliced: int = 0  # of ``shared``, tokens moved in from a run the donor holds elsewhere
    gap: int = 0  # tokens prefilled before that run (the engine finds them cached: they were not)
    rebuilt: bool = False  # the session's KV was dropped and is rebuilt (Timings.kv_rebuilt)

    def account(self, t: Timings) -> None:
        """Into the turn's timings, by the engine before it returns them: it found a built
        prefix in the slot as cached, but it was prefilled."""
        t.kv_rebuilt = self.rebuilt
        t.prefix_shared_n, t.prefix_built_n, t.prefix_spliced_n = self.shared, self.built, self.spliced
        if self.shared or self.built:
            t.prefix_source, t.prefix_ms, t.prefix_bytes = self.source, self.seconds * 1e3, self.loaded_bytes
        t.cache_n -= self.built + self.gap
        t.speculator_cache_n -= self.built
        t.prompt_n += self.built + self.gap
        t.speculator_prefill_n += self.built
        t.ttft_ms += self.seconds * 1e3


@dataclass(slots=True)
class Result:
    text: str
    finish_reason: str  # stop | length | cancelled
    tokens: list[int]
    timings: Timings
    kept: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did
