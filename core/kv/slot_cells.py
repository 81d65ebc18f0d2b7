"""A slot's KV in both models as whole units: saved and restored (parking, spill),
started from another resident session's dense prefix (a copy inside each context),
or from a shared prefix's saved state (the prefix cache)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence

import numpy as np

from core.errors import EngineError
from core.kv.positions import SessionKV, dense_prefix, speculator_backlog
from core.kv.rope import Rope, model_rope, rotate
from core.llama import seq_cells
from core.llama.context import Context
from core.spans import common_prefix
from core.specprefill.cost_model import Costs
from core.steps import Tokens, TurnSteps

SPLICE_BUFFER = 64 << 20  # a ~2K-token run of the 1.5B target's f16 KV is ~60 MB


class SlotCells:
    def __init__(self, target_ctx: Context, speculator_ctx: Context, costs: Costs,
                 calls: Callable[[int], int]) -> None:
        self.target_ctx, self.speculator_ctx, self.costs, self.calls = target_ctx, speculator_ctx, costs, calls
        # a spliced run's state out of and into the scratch sequence, kept between splices and
        # touched once here: on first touch their pages cost ~0.8 s per 60 MB on the 2-core VM
        self._out = bytearray(SPLICE_BUFFER) if target_ctx.scratch_seq >= 0 else bytearray()
        self._in = bytearray(SPLICE_BUFFER) if target_ctx.scratch_seq >= 0 else bytearray()

    def save(self, slot: int = 0, speculator: bool = True) -> tuple[bytes, bytes]:
        """The KV of both models in ``slot``, serialized (the speculator's left empty when not
        wanted: it holds other tokens than the target, and catches up later)."""
        return self.target_ctx.seq(slot).save(), self.speculator_ctx.seq(slot).save() if speculator else b""

    def load(self, blobs: tuple[bytes, bytes] | None, slot: int = 0) -> None:
        """Restore a saved session into ``slot``; None empties it (a fresh or evicted session)."""
        target, speculator = blobs or (b"", b"")
        self.target_ctx.seq(slot).load_state(target)
        self.speculator_ctx.seq(slot).load_state(speculator)

    def adopt_prefix(self, tokens: tuple[int, ...], kv: SessionKV, slot: int, donor: SessionKV,
                     donor_slot: int, min_tokens: int = 32) -> int:
        """Start the empty ``slot`` with the KV of the longest prefix of ``tokens`` that
        ``donor`` (resident in ``donor_slot``, idle) holds densely, in both models; returns
        the target tokens adopted.  Only tokens ``tokens`` itself carries are adopted, so a
        session never gains another's private context.  Between split streams the copy
        is a buffer copy, done before the next decode of that context."""
        adopted = 0
        for ctx, mine, theirs in ((self.target_ctx, kv.target, donor.target),
                                  (self.speculator_ctx, kv.speculator, donor.speculator)):
            n = min(dense_prefix(theirs, tokens), len(tokens) - 1)
            if n < min_tokens or mine.tokens:
                continue
            ctx.copy_seq(donor_slot, slot)
            ctx.seq(slot).remove_from(n)
            mine.extend(tokens[:n], range(n))
            if ctx is self.target_ctx:
                adopted = n
        return adopted

    def cut_prefix(self, tokens: tuple[int, ...], slot: int, holder: SessionKV,
                   with_scorer: bool = False) -> tuple[bytes, bytes] | None:
        """The state for exactly ``tokens``, cut from the idle session ``holder`` resident in
        ``slot``, which is left as it was: a shared prefix's cache entry, copied, never
        computed.  None when the target does not hold all of ``tokens`` densely, or, with
        ``with_scorer``, the speculator does not.  Else the speculator's part is empty where
        the scorer lags (deferred by the tool guard): a session restored from the entry
        catches its scorer up later, as the holder does."""
        n = len(tokens)
        if dense_prefix(holder.target, tokens) < n:
            return None
        scorer = dense_prefix(holder.speculator, tokens) >= n
        if with_scorer and not scorer:
            return None
        return _cut(self.target_ctx, slot, n), _cut(self.speculator_ctx, slot, n) if scorer else b""

    def catch_up_speculator(self, kv: SessionKV, slot: int, max_tokens: int) -> int:
        """Prefill up to ``max_tokens`` of what the scorer's sequence in ``slot`` lacks of the
        target's tokens (idle time: one decode, so a turn that arrives waits for this at
        most); returns the tokens decoded, 0 when there is nothing to catch up."""
        seq = self.speculator_ctx.seq(slot)
        start, tokens = speculator_backlog(kv, seq.n_ctx - 1)
        tokens = tokens[:max_tokens]
        if not tokens:
            return 0
        t0 = time.perf_counter()
        seq.decode(tokens, start, logits_last=False)
        self.costs.speculator.observe(len(tokens), start, self.calls(len(tokens)), time.perf_counter() - t0)
        kv.speculator.extend(tokens, range(start, start + len(tokens)))
        return len(tokens)

    def rewrite_tail(self, kv: SessionKV, slot: int, tokens: Sequence[int], max_tokens: int) -> int:
        """Make the target's tokens in ``slot`` read ``tokens`` (a held reply as the client will
        resend it, core.chat.ChatTemplate.resend_form): its cells from where the two part are
        dropped and the rest of ``tokens`` prefilled, in one decode (idle time: a turn that
        arrives waits for this at most).  The scorer is cut there too and catches up later.
        Returns the tokens prefilled; 0 when nothing differs, or more than ``max_tokens``."""
        target, seq = kv.target, self.target_ctx.seq(slot)
        keep = common_prefix(target.tokens, tokens)
        todo = list(tokens[keep:])
        if not todo or len(todo) > max_tokens or target.next_pos_at(keep) + len(todo) >= seq.n_ctx:
            return 0  # (positions, not tokens: a session past the window holds fewer cells than tokens)
        pos = target.truncate(keep)
        seq.remove_from(pos)
        if len(kv.speculator.tokens) > keep:
            self.speculator_ctx.seq(slot).remove_from(kv.speculator.truncate(keep))
        t0 = time.perf_counter()
        try:
            seq.decode(todo, pos, logits_last=False)
        except BaseException:
            seq.remove_from(pos)  # a failed decode may have left cells: the tokens end at ``keep``
            raise
        self.costs.target.observe(len(todo), pos, self.calls(len(todo)), time.perf_counter() - t0)
        target.extend(todo, range(pos, pos + len(todo)))
        return len(todo)

    def prefill_prefix(self, tokens: tuple[int, ...], kv: SessionKV, slot: int) -> TurnSteps[tuple[bytes, bytes]]:
        """Prefill ``tokens`` densely into the empty ``slot`` in both models (requests to the
        step loop), and return both sequences' state: a shared prefix's cache entry."""
        for ctx, state, cost in ((self.target_ctx, kv.target, self.costs.target),
                                 (self.speculator_ctx, kv.speculator, self.costs.speculator)):
            t0 = time.perf_counter()
            yield Tokens(ctx.seq(slot), tokens, 0, logits=False)
            cost.observe(len(tokens), 0, self.calls(len(tokens)), time.perf_counter() - t0)
            state.extend(tokens, range(len(tokens)))
        return self.save(slot)

    def restore_prefix(self, blobs: tuple[bytes, bytes], tokens: tuple[int, ...], kv: SessionKV, slot: int,
                       held: int | None = None) -> bool:
        """Start the empty ``slot`` from a saved dense prefix's state (:meth:`prefill_prefix`, a
        checkpoint) that holds ``held`` tokens, of which the first ``len(tokens)`` are kept
        (all by default); False, with the slot left empty, when llama.cpp cannot load it (a
        state written by another build or with other context settings: the caller builds)."""
        try:
            self.load(blobs, slot)
        except EngineError:
            self.load(None, slot)
            return False
        for ctx, state, blob in ((self.target_ctx, kv.target, blobs[0]),
                                 (self.speculator_ctx, kv.speculator, blobs[1])):
            if blob:  # an empty speculator part: the prefix is deferred there
                if held is not None and held > len(tokens):
                    ctx.seq(slot).remove_from(len(tokens))
                state.extend(tokens, range(len(tokens)))
        return True

    def splice(self, slot: int, donor_slot: int, src: int, dst: int, n: int) -> int:
        """Append to the target's sequence in ``slot`` the ``n`` cells the sequence in
        ``donor_slot`` holds at positions [src, src + n), moved to [dst, dst + n) with their K
        rotated for the move (core.kv.rope): a run of another conversation's KV reused at
        another position, without a K-shift of the whole context.  Returns the bytes moved.
        The cells keep what they attended to where they were computed: an approximation
        (llama-server's ``--cache-reuse`` makes the same one), exact in their own run.

        In a unified cache only the run's cells travel, through the scratch sequence: tagged
        there, saved, rewritten, loaded back as new cells and shared with the slot.  Between
        split streams both sequences are saved whole, joined and loaded back."""
        rope = model_rope(self.target_ctx.model)
        if rope is None:
            raise EngineError("this model's rotary embedding cannot be applied again to saved K")
        ctx = self.target_ctx
        seq, donor = ctx.seq(slot), ctx.seq(donor_slot)
        if ctx.scratch_seq < 0:
            run = _moved(seq_cells.parse(donor.save(), donor.id), src, dst, n, rope)
            mine = seq_cells.parse(seq.save(), seq.id)
            seq.load_state(seq_cells.write(mine.join(dataclasses.replace(run, seq_id=seq.id))))
            return sum(x.nbytes for x in (*run.k, *run.v))
        scratch = ctx.scratch()
        scratch.clear_cells()
        try:
            ctx.share_cells(donor.id, scratch.id, src, src + n)
            run = _moved(seq_cells.parse(scratch.save_to(self._out), scratch.id), src, dst, n, rope)
            scratch.load_buffer(seq_cells.write_into(run, self._in))
            ctx.share_cells(scratch.id, seq.id, dst, dst + n)
        finally:
            scratch.clear_cells()
        return sum(x.nbytes for x in (*run.k, *run.v))


def _cut(ctx: Context, slot: int, n: int) -> bytes:
    """The first ``n`` positions of ``slot``'s sequence, saved.  In a unified cache they are
    tagged with the scratch sequence and saved from there (only those cells are copied);
    between split streams the sequence is saved whole, cut, saved and put back."""
    if ctx.scratch_seq >= 0:
        via = ctx.scratch()
        via.clear_cells()
        try:
            ctx.share_cells(slot, via.id, 0, n)
            return via.save()
        finally:
            via.clear_cells()
    seq = ctx.seq(slot)
    whole = seq.save()
    try:
        seq.remove_from(n)
        return seq.save()
    finally:
        seq.load_state(whole)


def _moved(theirs: seq_cells.Cells, src: int, dst: int, n: int, rope: Rope) -> seq_cells.Cells:
    """The cells of ``theirs`` at positions [src, src + n), in position order, relabelled to
    [dst, dst + n) with their K rotated by the distance."""
    at = np.flatnonzero((theirs.positions >= src) & (theirs.positions < src + n))
    at = at[np.argsort(theirs.positions[at])]
    if not np.array_equal(theirs.positions[at], np.arange(src, src + n)):
        raise EngineError(f"the donor does not hold every position in [{src}, {src + n})")
    run = theirs.take(at)
    k = tuple(seq_cells.from_rows(rotate(seq_cells.k_rows(rows, kind), dst - src, rope), kind)
              for rows, kind in zip(run.k, run.k_types, strict=True))
    return dataclasses.replace(run, positions=np.arange(dst, dst + n, dtype=np.int32), k=k)
