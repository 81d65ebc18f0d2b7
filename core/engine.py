"""The engine: speculator + target, and one request's flow through them.

    prompt -> plan (guards, break-even) -> score -> select -> prefill -> decode

A turn is a generator (:meth:`Engine.turn`, see core.steps) over one slot --
one sequence id in each model's context -- so the step loop (core.runtime.step_loop)
can batch several turns' tokens; :meth:`Engine.run` runs one turn alone.  All
methods run on the caller's thread; the gateway calls them only from the model
worker thread (core.runtime.worker), never from the event loop.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from collections.abc import Callable, Sequence

import numpy as np

from core import startup
from core.chat import ChatTemplate
from core.config import EngineConfig, check_kv_type
from core.decoding import layer_map
from core.decoding.decode import Generation, OnText, generate
from core.decoding.drafts import copy_views
from core.decoding.guided import Guide
from core.decoding.lookup import LookupDecoder
from core.decoding.mode_speeds import COPY, FREE, ModeSpeeds
from core.decoding.specattn import SparseVerify, layer_weights
from core.decoding.speculative import SpeculativeDecoder
from core.errors import EmptyPrompt, InvalidRequest, PromptTooLong
from core.kv import cells
from core.kv.eviction import plan_fit, protected
from core.kv.positions import (
    SessionKV,
    SpeculatorSync,
    TokenCells,
    cached_indices,
)
from core.kv.recall import Recall
from core.kv.scoring_window import ScoringWindow
from core.kv.slot_cells import SlotCells
from core.kv.sparse_prefill import measured_prefill
from core.kv.window_fit import apply_fit
from core.llama import seq_cells
from core.llama.capture import make_capture
from core.llama.context import Context, Seq
from core.llama.model import Model
from core.loader import override
from core.models import model_files, prefill_settings
from core.models.scorer_cuts import scoring_model
from core.policies import DecodeMode, DecodingPolicy, PrefillPolicy, SamplingParams, TurnParams
from core.prompt import Prompt
from core.results import PrefixStart, Result, Status, Timings
from core.spans import common_prefix, runs
from core.specprefill import guard as tool_guard
from core.specprefill import planner
from core.specprefill.content import ContentKind, content_kind
from core.specprefill.cost_model import Costs, Work
from core.specprefill.lines import lines_of, names_in, recall
from core.specprefill.scoring import importance
from core.specprefill.selection import bridge_gaps, forced_mask, select_tokens
from core.speculator import Speculator
from core.steps import TurnSteps, drive


def turn_kind(prompt: Prompt, params: TurnParams) -> str:
    """``copy`` when the reply likely copies its context: the prompt ends with a tool result
    (an agent that just read a file), or the reply is a forced call; else ``free``."""
    last = prompt.spans[-1].role if prompt.spans else ""
    constraint = params.sampling.constraint
    return COPY if last == "tool" or (constraint is not None and constraint.kind == "tool_call") else FREE


NOT_NAMES = re.compile(r'<\|[^|]*\|>|"[A-Za-z_]\w*"\s*:')  # special tokens, JSON keys
REPLY_ROOM = 1024  # cells a turn leaves for its reply before the session evicts (max_tokens if less)
KIND_SAMPLE = 4096  # tokens read to tell code from logs and prose (core.specprefill.content)


class Engine:
    """Owns both models and their contexts, each with ``config.slots`` sequences.

    ``speculator`` is the scoring model: the speculator itself, its Q4_0 copy, or an
    early-layer cut of either model (``config.scorer``, core.models.scorer_cuts)."""

    def __init__(self, config: EngineConfig) -> None:
        if config.n_ctx == 0:  # built without with_default_models: the target's trained context
            config = override(config, n_ctx=model_files.trained_context(config.target))
        self.config = config
        self.target = Model(config.target)
        try:
            self.speculator = Model(scoring_model(config.scorer, config.target, config.speculator))
        except Exception:
            self.target.close()
            raise
        try:
            startup.check_same_vocab(self.speculator, self.target)
            startup.check_memory(config, self.target, self.speculator)
            self.capture = make_capture(prefill_settings.scoring_capture(config.attention_capture, self.speculator),
                                        self.speculator.n_layer)
            target_flash = prefill_settings.resolve(config.target_flash_attn, self.target)
            check_kv_type(config.kv_type, target_flash, self.capture.flash_attn)
            unified = config.kv_layout == "unified"
            self.target_ctx = Context(self.target, n_ctx=config.n_ctx, n_batch=config.n_batch,
                                      n_ubatch=config.n_ubatch, n_threads=config.n_threads, flash_attn=target_flash,
                                      views=unified or config.slots == 1, n_seq=config.slots,
                                      unified=unified or config.slots == 1, kv_type=config.kv_type)
            self.speculator_ctx = Context(self.speculator, n_ctx=config.speculator_ctx_len, n_batch=config.n_batch,
                                          n_ubatch=config.n_ubatch, n_threads=config.n_threads,
                                          flash_attn=self.capture.flash_attn, capture=self.capture, n_seq=config.slots,
                                          # a captured row's columns are the sequence's own cells in order:
                                          # the scorer keeps a stream per slot in either layout
                                          unified=config.slots == 1, kv_type=config.kv_type)
            self.window = self._scoring_window(config)
        except Exception:
            self.close()
            raise
        self.chat = ChatTemplate(self.target)
        self.layer_map = layer_map.load(self.target, self.speculator, config.layer_map)
        self.costs = Costs()
        self.mode_speeds = ModeSpeeds()
        for ctx, cost in ((self.target_ctx, self.costs.target), (self.speculator_ctx, self.costs.speculator)):
            if not ctx.movable_labels:  # slots share cells, and no scratch sequence to move them apart
                cost.move_s_per_cell = math.inf
        self.spec = Speculator(self.speculator_ctx, self.capture, self.costs, self._calls, self.window)
        self.recaller = Recall()
        self.slot_cells = SlotCells(self.target_ctx, self.speculator_ctx, self.costs, self._calls)
        if config.calibrate_tokens:
            self.calibrate(config.calibrate_tokens)

    def _scoring_window(self, config: EngineConfig) -> ScoringWindow | None:
        """The scratch context of windowed scoring prefills (core.kv.scoring_window), same
        settings as the speculator's own so saved states move between the two."""
        if not config.scoring_window:
            return None
        ctx = Context(self.speculator, n_ctx=self.speculator_ctx.n_ctx, n_batch=config.n_batch,
                      n_ubatch=config.n_ubatch, n_threads=config.n_threads, flash_attn=self.speculator_ctx.flash_attn,
                      views=True, n_seq=1, kv_type=config.kv_type)
        return ScoringWindow(ctx, config.scoring_window)

    def close(self) -> None:
        window = getattr(self, "window", None)
        if window is not None:
            window.close()
        for obj in ("speculator_ctx", "target_ctx"):
            if hasattr(self, obj):
                getattr(self, obj).close()
        self.speculator.close()
        self.target.close()

    @property
    def slots(self) -> int:
        return self.target_ctx.n_seq

    def state_layout(self) -> str:
        """What a saved KV state depends on besides the model files, for the KV tier's
        fingerprint: llama.cpp refuses a state saved with another stream count, and would
        misread one with V stored the other way (transposed without flash attention)."""
        parts = [f"slots={self.config.slots}", f"layout={self.config.kv_layout}"]
        for role, ctx in (("target", self.target_ctx), ("scorer", self.speculator_ctx)):
            parts.append(f"{role}={ctx.model.path.name}:streams={ctx.n_stream}:fa={int(ctx.flash_attn)}"
                         f":v_trans={int(not ctx.flash_attn)}:kv={ctx.kv_type}")
        return ";".join(parts)

    # -- measurement --------------------------------------------------------
    def calibrate(self, n_tokens: int) -> None:
        """Seed the cost functions (see :func:`core.startup.calibrate`)."""
        startup.calibrate(self.target_ctx, self.speculator_ctx, self.costs, self._calls, n_tokens)

    def reserve_buffers(self, slot: int) -> bool:
        """Idle time: grow the kept buffers a turn of the session in ``slot`` copies its states
        through (a moved label where cells are private, the scoring window's saved states) to
        hold them with room to grow, so the turn does not pay fresh pages: the first bridge at
        17K cells took 2.4 s with them, 0.06 s without (the 1.5B target, the 2-core VM).
        Returns whether anything grew."""
        target = self.target_ctx.seq(slot)
        grew = self.target_ctx.private_cells and seq_cells.reserve(self.target_ctx.move_buffer, target.state_size())
        if self.window is not None:
            grew = self.window.reserve(self.speculator_ctx.seq(slot)) or grew
        return grew

    def prefill_seconds(self, ctx: Context, n: int, pos: int) -> float:
        """What ``n`` more tokens after ``pos`` cost in ``ctx`` in one call, by the measured costs."""
        return (self.costs.target if ctx is self.target_ctx else self.costs.speculator).seconds(n, pos, 1)

    # -- one request ----------------------------------------------------------
    def check_prompt(self, prompt: Prompt) -> None:
        n = len(prompt)
        if n == 0:
            raise EmptyPrompt("the prompt is empty")
        limit = self.config.context_limit
        if n > limit:
            raise PromptTooLong(n, limit)

    def check_turn(self, prompt: Prompt, params: TurnParams) -> None:
        """What makes a turn impossible, raised before a session's KV is touched (a refused
        request must not cost it its cache): the prompt against the context, and a decoding
        mode this server cannot run (:class:`InvalidRequest`)."""
        self.check_prompt(prompt)
        self._check_fits(prompt, params)
        policy = params.decoding
        if policy.mode is DecodeMode.SPECATTN and self.target_ctx.view_seq < 0:
            raise InvalidRequest("specattn needs a unified KV cache: start the server with --kv-layout unified "
                                 "(or --slots 1)")
        if policy.mode is not DecodeMode.PLAIN and not self.config.scorer_drafts:
            raise InvalidRequest(f"speculative decoding drafts with a whole speculator, but this server scores "
                                 f"with {self.config.scorer}: start it with --scorer speculator-full")

    @property
    def kv_window(self) -> int:
        """The cells a session may hold in both models (past it, it evicts: :meth:`_fit`)."""
        return min(self.target_ctx.n_ctx, self.speculator_ctx.n_ctx) - 1

    def _check_fits(self, prompt: Prompt, params: TurnParams) -> None:
        """A prompt past the window is served only if what eviction never drops (its
        instructions, what users type and tool calls: core.kv.eviction) fits with room for the
        reply."""
        if len(prompt) <= self.kv_window:
            return
        must = int(protected(len(prompt), prompt.spans, 0).sum()) + min(params.sampling.max_tokens, REPLY_ROOM)
        if must > self.kv_window:
            raise PromptTooLong(must, self.kv_window, "what a prompt past the window must keep, with its reply,")

    def _ceiling(self, params: TurnParams, n: int, t: Timings) -> TurnParams:
        """``max_tokens`` is a ceiling, never a refusal: clamped to what the context leaves
        after the prompt (and, by the gateway, to the cap); the timings say when it was."""
        sampling = params.sampling
        ceiling = min(sampling.max_tokens, self.target_ctx.n_ctx - n)
        asked = max(sampling.max_tokens_asked, sampling.max_tokens)
        t.max_tokens, t.max_tokens_asked = ceiling, asked if asked > ceiling else 0
        if ceiling == sampling.max_tokens:
            return params
        return dataclasses.replace(params, sampling=dataclasses.replace(sampling, max_tokens=ceiling))

    def _calls(self, n: int) -> int:
        """llama_decode calls a prefill of ``n`` tokens takes."""
        return max(1, -(-n // self.config.n_batch))

    def plan(self, prompt: Prompt, policy: PrefillPolicy, kv: SessionKV | None = None,
             costs: Costs | None = None, sync: SpeculatorSync | None = None) -> planner.Plan:
        """The planner's decision for ``prompt`` against a session's caches (none: fresh),
        with the engine's measured costs unless others are given, and the speculator
        reaching the prompt as ``sync`` says (else as :meth:`Speculator.plan_sync` decides)."""
        kv = kv or SessionKV()
        n = len(prompt)
        q = min(common_prefix(kv.target.tokens, prompt.tokens), n - 1)
        sync = sync or self.spec.plan_sync(kv, prompt.tokens[:-1])
        scanned = "".join(self.target.detokenize(prompt.tokens[a:b], special=True)
                          for a, b in tool_guard.scan_spans(prompt, policy.guard_scan_tokens))
        verdict = tool_guard.inspect(prompt, scanned, policy)
        dense = forced_mask(n - q, 0, 0, [(a - q, b - q) for a, b in verdict.spans if b > q])
        work = Work(n_select=n - q, n_protected=int(dense.sum()), target_cached=len(cached_indices(kv.target, q)),
                    n_score=n - sync.start, speculator_cached=sync.cells, lookahead=policy.lookahead,
                    n_batch=self.config.n_batch, compact=policy.position_mode == "compact",
                    n_rebuild=sync.n_rebuild, rebuild_runs=sync.rebuild_runs,
                    kind=self._content_kind(prompt.tokens[q:], dense),
                    speculator_span=self.spec.span(sync.start, n - sync.start - 1))
        return planner.plan(work, policy, verdict, costs or self.costs)

    def _content_kind(self, delta: Sequence[int], dense: np.ndarray) -> ContentKind:
        """What the tokens free to drop are: code, logs or prose (read from up to
        ``KIND_SAMPLE`` of them, evenly through the delta)."""
        free = np.flatnonzero(~dense)
        if free.size > KIND_SAMPLE:
            free = free[np.linspace(0, free.size - 1, KIND_SAMPLE).astype(np.int64)]
        return content_kind(self.target.detokenize([delta[int(i)] for i in free]))

    def _request_names(self, prompt: Prompt) -> frozenset[bytes]:
        """The names the turn's request holds: its last user message and the tool calls after
        it (the template's special tokens and JSON keys are not names)."""
        users = [i for i, s in enumerate(prompt.spans) if s.role == "user"]
        if not users:
            return frozenset()
        spans = [s for s in prompt.spans[users[-1]:] if s.role == "user" or s.tool_calls]
        text = " ".join(self.target.detokenize(prompt.tokens[s.start:s.end]) for s in spans)
        return names_in(NOT_NAMES.sub(" ", text))

    def score(self, kv: SessionKV, tokens: tuple[int, ...], policy: PrefillPolicy, t: Timings,
              slot: int = 0, sync: SpeculatorSync | None = None) -> TurnSteps[np.ndarray]:
        """Per-token importance over all of ``tokens`` (see :meth:`Speculator.capture_steps`)."""
        steps = yield from self.spec.capture_steps(kv, tokens, policy.lookahead, t, slot, sync)
        return importance(steps, len(tokens), policy.pool_kernel, policy.boost_first_n, policy.boost_first_mult,
                          policy.boost_last_n, policy.boost_last_mult, policy.score_agg)

    def run(self, prompt: Prompt, params: TurnParams, on_text: OnText | None = None,
            kv: SessionKV | None = None, abort: Callable[[], bool] | None = None, slot: int = 0) -> Result:
        """One turn, alone (see :meth:`turn`).  ``abort`` is polled between prefill batches
        (:class:`TurnCancelled` when it says so)."""
        self.target_ctx.abort = self.speculator_ctx.abort = abort
        try:
            return drive(self.turn(prompt, params, on_text, kv, slot))
        finally:
            self.target_ctx.abort = self.speculator_ctx.abort = None

    def turn(self, prompt: Prompt, params: TurnParams, on_text: OnText | None = None,
             kv: SessionKV | None = None, slot: int = 0, checked: bool = False,
             start: PrefixStart | None = None) -> TurnSteps[Result]:
        """One turn in ``slot``.  With ``kv`` (the session whose KV the slot holds) only
        the delta against the session's tokens is prefilled; without it, the slot is
        emptied first.  ``checked``: the caller checked the turn (``check_turn``) already.
        ``start``: how the session's KV started this turn (core.runtime.seating), counted in
        the timings returned."""
        if not checked:
            self.check_turn(prompt, params)
        params = self._pick_decoding(params, prompt)
        persistent = kv is not None
        if kv is None:
            kv = SessionKV()
            self.slot_cells.load(None, slot)
        target = self.target_ctx.seq(slot)
        policy = params.prefill
        tokens, n = prompt.tokens, len(prompt)
        # the last prompt token is always decoded again: its logits start generation
        q = min(common_prefix(kv.target.tokens, tokens), n - 1)
        p = min(common_prefix(kv.speculator.tokens, tokens), n - 1)
        cells.rollback(target, kv.target, q)
        delta = tokens[q:]
        t = Timings(position_mode=policy.position_mode, context_n=n, cache_n=q,
                    speculator_cache_n=p, turn_kind=turn_kind(prompt, params))
        names = self._request_names(prompt) if policy.selection.named_lines else frozenset()
        if persistent and names:
            yield from self._recall(prompt, names, policy, kv.target, target, t)
        absorbed = yield from self._fit(prompt, params, kv, slot, t)
        before_fit, q = q, len(kv.target.tokens)  # past q: new tokens the fit prefilled already
        delta = tokens[q:]
        if kv.target.packed:
            params = self._packed_decoding(params)
        t.physical_n = kv.target.end_pos + len(delta)
        params = self._ceiling(params, t.physical_n, t)
        t_start = time.perf_counter()  # scoring's share of the TTFT starts here
        sync = self.spec.plan_sync(kv, tokens[:-1])  # decided once: the plan and the scoring agree
        decision = self.plan(prompt, policy, kv, sync=sync)
        t.specprefill, t.specprefill_reason = decision.status.value, decision.reason
        t.content_kind = decision.kind.value
        kept = np.arange(len(delta))
        if decision.score:
            kv.scores = yield from self.score(kv, tokens, policy, t, slot, sync)
            scores = kv.scores[q:]
            protected = tuple((max(0, a - q), b - q) for a, b in decision.protected if b > q)
            sel = policy.selection
            widened = sel.whole_lines or sel.code_blocks or sel.code_skeleton or sel.named_lines
            lines = lines_of([self.target.token_bytes(x) for x in delta], names) if widened else None
            kept = select_tokens(scores, sel, protected, lines, decision.kind is ContentKind.CODE)
            if policy.position_mode == "original" and policy.bridge:
                kept = bridge_gaps(kept, self.costs.target.bridge_tokens(len(kv.target.tokens)))
            t.scoring_ms = (time.perf_counter() - t_start) * 1e3
            n_dense = int(forced_mask(len(delta), 0, 0, protected).sum())
            self.costs.observe_selection(len(delta) - n_dense, int(kept.size) - n_dense, int(kept.size),
                                         len(runs(kept)), decision.kind)
            if kept.size == len(delta):
                t.specprefill, t.specprefill_reason = Status.KEPT_ALL.value, "selection kept every token"
        elif persistent and self._scores_ahead(policy, kv, tokens, len(delta)):
            t0 = time.perf_counter()
            yield from self.spec.sync(self.speculator_ctx.seq(slot), kv.speculator, tokens[:-1], t)
            t.scoring_ms = (time.perf_counter() - t0) * 1e3
        t.prompt_n, t.kept_runs = int(kept.size) + absorbed, len(runs(kept))
        views = self._copy_views(prompt) if params.decoding.mode is DecodeMode.LOOKUP else ()
        gen = yield from self.prefill_and_decode(kv, delta, kept, params, on_text, t, tokens, slot, views)
        t.ttft_ms = t.recall_ms + t.evict_ms + t.scoring_ms + t.prompt_ms + gen.first_token_s * 1e3
        if persistent:
            # the speculator catches up on what it lacks (a skipped turn, the reply) only when a
            # later turn scores: never on this reply's path
            context = tokens + tuple(gen.tokens[: gen.n_decoded])
            t.speculator_deferred_n = len(context) - common_prefix(kv.speculator.tokens, context)
        if start is not None:
            start.account(t)
        held = np.flatnonzero(np.asarray(kv.target.kv_pos[before_fit:q]) >= 0) + before_fit
        return Result(gen.text, gen.finish_reason, gen.tokens, t, np.concatenate((held, kept + q)), gen.stop_sequence)

    def _fit(self, prompt: Prompt, params: TurnParams, kv: SessionKV, slot: int, t: Timings) -> TurnSteps[int]:
        """Make the turn fit the window: past it, the session drops its least important cells
        and packs the rest (core.kv.eviction, core.kv.window_fit).  Returns the new tokens
        prefilled on the way (a prompt longer than the window, with too little cached)."""
        reply = min(params.sampling.max_tokens, REPLY_ROOM)
        scored = params.prefill.evict_order == "scored"
        scores = kv.scores_over(len(prompt), len(kv.target.tokens) if scored else 0)  # NaN: oldest first
        fit = plan_fit(prompt, kv.target, scores, self.kv_window, reply, self.config.recent_tokens)
        if fit is None:
            return 0
        t0 = time.perf_counter()
        added = yield from apply_fit(fit, prompt.tokens, kv, self.target_ctx.seq(slot), self.speculator_ctx.seq(slot))
        t.evicted_n, t.evict_ms = fit.dropped, (time.perf_counter() - t0) * 1e3
        return added

    @staticmethod
    def _packed_decoding(params: TurnParams) -> TurnParams:
        """Draft-model and SpecAttn decoding keep the drafting model at the target's logical
        positions, which a packed session no longer has: it decodes plainly (or by lookup)."""
        if params.decoding.mode not in (DecodeMode.SPECULATIVE, DecodeMode.SPECATTN):
            return params
        return dataclasses.replace(params, decoding=dataclasses.replace(params.decoding, speculative=False,
                                                                        specattn=False))

    def _recall(self, prompt: Prompt, names: frozenset[bytes], policy: PrefillPolicy, kv: TokenCells, seq: Seq,
                t: Timings) -> TurnSteps[None]:
        """Prefill back the tokens earlier turns dropped on lines naming one of ``names``
        (core.kv.recall), where the session's cells sit at their logical positions.  Lines are
        read from the message holding the first dropped token on: none before it can be recalled."""
        sel = policy.selection
        if not (policy.enabled and sel.named_lines and sel.max_recall_tokens) or self.recaller.busy:
            return
        pos = np.asarray(kv.kv_pos, dtype=np.int64)
        dropped = pos < 0
        if not dropped.any() or not np.all(dropped | (pos == np.arange(pos.size))):
            return
        first = int(np.argmax(dropped))
        start = max((s.start for s in prompt.spans if s.start <= first), default=0)
        lines = lines_of([self.target.token_bytes(x) for x in kv.tokens[start:]], names)
        found = recall(dropped[start:], lines, sel.max_recall_tokens, max_line_tokens=sel.max_line_tokens) + start
        if not found.size:
            return
        t0 = time.perf_counter()
        cost = self.costs.target
        yield from self.recaller.run(seq, kv, found, seq.ctx.movable_labels and cost.relabels(kv.n_cached))
        t.recalled_n, t.recall_ms = int(found.size), (time.perf_counter() - t0) * 1e3

    def _scores_ahead(self, policy: PrefillPolicy, kv: SessionKV, tokens: tuple[int, ...], dense: int) -> bool:
        """Whether a turn that is not scored, and prefills ``dense`` tokens into the target,
        brings its scorer up to its prompt anyway: both are at least ``scorer_ahead_tokens``
        (a lag idle time cannot catch up before an agent's next tool turn, on a turn that
        costs minutes already), and the scoring window keeps the scorer's prefill linear.
        Otherwise the first tool turns of a fresh server find their scorer thousands of tokens
        behind and run densely (issue 52).  A sibling that adopted its prefix prefills a few
        tokens: it is left to idle time."""
        ahead = policy.scorer_ahead_tokens
        if not policy.enabled or not ahead or self.window is None or dense < ahead:
            return False
        return len(tokens) - 1 - common_prefix(kv.speculator.tokens, tokens) >= ahead

    def _pick_decoding(self, params: TurnParams, prompt: Prompt) -> TurnParams:
        """``decode_auto``: a turn that asks for no mode decodes in the one measured fastest at
        its depth for its kind of turn (core.decoding.mode_speeds)."""
        policy = params.decoding
        if not policy.decode_auto or policy.mode is not DecodeMode.PLAIN:
            return params
        modes = [DecodeMode.LOOKUP]
        if self.config.scorer_drafts:
            modes.append(DecodeMode.SPECULATIVE)
            if self.target_ctx.view_seq >= 0:
                modes.append(DecodeMode.SPECATTN)
        mode = self.mode_speeds.pick(len(prompt), modes, turn_kind(prompt, params))
        if mode is DecodeMode.PLAIN:
            return params
        return dataclasses.replace(params, decoding=dataclasses.replace(
            policy, lookup=mode is DecodeMode.LOOKUP, speculative=mode in (DecodeMode.SPECULATIVE, DecodeMode.SPECATTN),
            specattn=mode is DecodeMode.SPECATTN))

    def prefill_and_decode(self, kv_all: SessionKV, delta: tuple[int, ...], kept: np.ndarray,
                           params: TurnParams, on_text: OnText | None, t: Timings,
                           prompt: tuple[int, ...], slot: int = 0,
                           views: tuple[int, ...] = ()) -> TurnSteps[Generation]:
        seq, kv, mode = self.target_ctx.seq(slot), kv_all.target, params.prefill.position_mode
        # original mode keeps logical positions (bridging any gap); compact packs after the cache
        base = kv.end_pos if mode == "original" else kv.next_pos
        calls = self._calls(kept.size) if mode == "compact" else sum(self._calls(b - a) for a, b in runs(kept))
        n_past, idx, moves, seconds = yield from measured_prefill(seq, delta, kept, mode, base, self.costs.target,
                                                                  kv.n_cached, calls)
        t.prompt_ms, t.bridge_moves, t.bridge_ms = seconds * 1e3, moves.count, moves.seconds * 1e3
        kv.extend_kept(delta, kept, base, compact=mode == "compact")
        if params.decoding.mode is DecodeMode.PLAIN:
            gen = yield from generate(seq, n_past, params.sampling, on_text, idx)
        elif params.decoding.mode is DecodeMode.LOOKUP:
            gen = yield from self.look_up(seq, [*kv.tokens, *views], n_past, params.sampling, on_text, t, idx)
        else:  # a constrained reply too: its drafts are sampled and verified under the grammar's mask
            gen = yield from self.speculate(kv_all, prompt, params.decoding, params.sampling, on_text, t, slot, idx)
        if constraint := params.sampling.constraint:
            t.constraint, t.grammar_ms, t.mask_ms = constraint.kind, gen.grammar_ms, gen.mask_ms
        kv.extend(gen.tokens[: gen.n_decoded], range(n_past, n_past + gen.n_decoded))
        self.mode_speeds.observe(params.decoding.mode, n_past, len(gen.tokens), gen.decode_s, t.turn_kind)
        t.decode_auto = params.decoding.decode_auto
        t.predicted_ms = gen.decode_s * 1e3
        t.predicted_n = len(gen.tokens)
        return gen

    def _copy_views(self, prompt: Prompt) -> tuple[int, ...]:
        """The prompt's last tool results as a reply copies them (core.decoding.drafts.copy_views:
        a file read without its line numbers, and as a JSON string), tokenized for lookup."""
        results = [self.target.detokenize(prompt.tokens[s.start:s.end]) for s in prompt.spans[-8:] if s.role == "tool"]
        return tuple(tok for view in copy_views(results)
                     for tok in self.target.tokenize(view, add_special=False, parse_special=False))

    def look_up(self, seq: Seq, context: list[int], n_past: int, sampling: SamplingParams, on_text: OnText | None,
                t: Timings, idx: int) -> TurnSteps[Generation]:
        """Prompt-lookup decoding (core.decoding.lookup): drafts copied from ``context``, the
        session's logical tokens and the tool results' copy views; a step with no draft is a
        plain one, batched with the others."""
        guide = Guide(self.target, sampling.constraint) if sampling.constraint is not None else None
        gen, stats = yield from LookupDecoder(seq, guide).generate(context, n_past, sampling, on_text, idx)
        t.decode_mode, t.speculative = DecodeMode.LOOKUP.value, stats
        if guide is not None:
            gen.grammar_ms, gen.mask_ms = guide.compile_s * 1e3, guide.mask_s * 1e3
        return gen

    def speculate(self, kv: SessionKV, prompt: tuple[int, ...], policy: DecodingPolicy, sampling: SamplingParams,
                  on_text: OnText | None, t: Timings, slot: int = 0, idx: int = -1) -> TurnSteps[Generation]:
        """Speculative decoding from the prefilled target; the draft catches up on the
        prompt after the first token is out (so it does not delay TTFT).  It decodes
        unbatched, yielding a step to the other turns between rounds."""
        sparse = None
        if policy.mode is DecodeMode.SPECATTN:
            weights = layer_weights(np.asarray(self.layer_map.mapping), self.speculator.n_layer)
            sparse = SparseVerify(weights, policy.specattn_p)
        draft = self.speculator_ctx.seq(slot)
        guide = Guide(self.target, sampling.constraint) if sampling.constraint is not None else None
        decoder = SpeculativeDecoder(self.target_ctx.seq(slot), draft, self.capture, policy.gamma, sparse, guide)

        def draft_ready() -> tuple[list[int], int, list[int]]:
            t0 = time.perf_counter()
            if kv.speculator.tokens != list(prompt):
                base = drive(self.spec.sync(draft, kv.speculator, prompt[:-1], t))
                pending, pos = [prompt[-1]], base
            else:
                pending, pos = [], kv.speculator.next_pos
            t.draft_sync_ms = (time.perf_counter() - t0) * 1e3
            return pending, pos, cached_indices(kv.speculator)

        out = yield from decoder.generate(kv.target.kv_pos, draft_ready, sampling, on_text, idx)
        kv.speculator.extend(out.draft_committed, range(out.draft_pos, out.draft_pos + len(out.draft_committed)))
        t.decode_mode, t.speculative = policy.mode.value, out.stats
        if guide is not None:
            out.gen.grammar_ms, out.gen.mask_ms = guide.compile_s * 1e3, guide.mask_s * 1e3
        return out.gen
