"""A slot's KV in both models as whole units: saved and restored (parking, spill),
started from another resident session's dense prefix (a copy inside each context),
or from a shared prefix's saved state (the prefix cache)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np

from core.errors import EngineError
from core.kv.positions import SessionKV, dense_prefix, speculator_backlog
from core.kv.rope import model_rope, rotate
from core.llama import seq_cells
from core.llama.context import Context
from core.specprefill.cost_model import Costs
from core.steps import Tokens, TurnSteps


class SlotKV:
    def __init__(self, target_ctx: Context, speculator_ctx: Context, costs: Costs,
                 calls: Callable[[int], int]) -> None:
        self.target_ctx, self.speculator_ctx, self.costs, self.calls = target_ctx, speculator_ctx, costs, calls

    def save(self, slot: int = 0, speculator: bool = True) -> tuple[bytes, bytes]:
        """The KV of both models in ``slot``, serialized (the speculator's left empty when not
        wanted: it holds other tokens than the target, and catches up later)."""
        return self.target_ctx.seq(slot).save(), self.speculator_ctx.seq(slot).save() if speculator else b""

    def load(self, blobs: tuple[bytes, bytes] | None, slot: int = 0) -> None:
        """Restore a saved session into ``slot``; None empties it (a fresh or evicted session)."""
        target, speculator = blobs or (b"", b"")
        self.target_ctx.seq(slot).load(target)
        self.speculator_ctx.seq(slot).load(speculator)

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

    def copy_prefix(self, tokens: tuple[int, ...], slot: int, donor: SessionKV,
                    donor_slot: int) -> tuple[bytes, bytes] | None:
        """The state for exactly ``tokens``, copied from ``donor`` (resident in ``donor_slot``,
        idle) through the empty ``slot``, which is left empty again; None when the donor does
        not hold all of ``tokens`` densely in the target.  The speculator's part is empty
        when the donor's speculator does not hold them (deferred by the tool guard): a session
        restored from it catches its speculator up later, as that donor would have."""
        n = len(tokens)
        if dense_prefix(donor.target, tokens) < n:
            return None
        with_speculator = dense_prefix(donor.speculator, tokens) >= n
        for ctx in (self.target_ctx, self.speculator_ctx) if with_speculator else (self.target_ctx,):
            ctx.copy_seq(donor_slot, slot)
            ctx.seq(slot).remove_from(n)
        blobs = (self.target_ctx.seq(slot).save(), self.speculator_ctx.seq(slot).save() if with_speculator else b"")
        self.load(None, slot)
        return blobs

    def cut_prefix(self, tokens: tuple[int, ...], slot: int, holder: SessionKV) -> tuple[bytes, bytes] | None:
        """The state for exactly ``tokens`` in both models, cut from the idle session resident
        in ``slot`` (its own KV is saved first and put back after): a shared prefix's entry
        gains the speculator's part once idle catch-up has brought a session's scorer past it.
        None when the session does not hold all of ``tokens`` densely in both models."""
        n = len(tokens)
        if min(dense_prefix(holder.target, tokens), dense_prefix(holder.speculator, tokens)) < n:
            return None
        whole = self.save(slot)
        try:
            for ctx in (self.target_ctx, self.speculator_ctx):
                ctx.seq(slot).remove_from(n)
            return self.save(slot)
        finally:
            self.load(whole, slot)

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
        (llama-server's ``--cache-reuse`` makes the same one), exact in their own run."""
        rope = model_rope(self.target_ctx.model)
        if rope is None:
            raise EngineError("this model's rotary embedding cannot be applied again to saved K")
        seq, donor = self.target_ctx.seq(slot), self.target_ctx.seq(donor_slot)
        theirs = seq_cells.parse(donor.save(), donor.id)
        at = np.flatnonzero((theirs.positions >= src) & (theirs.positions < src + n))
        at = at[np.argsort(theirs.positions[at])]
        if not np.array_equal(theirs.positions[at], np.arange(src, src + n)):
            raise EngineError(f"the donor does not hold every position in [{src}, {src + n})")
        run = theirs.take(at)
        k = tuple(seq_cells.from_rows(rotate(seq_cells.k_rows(rows, kind), dst - src, rope), kind)
                  for rows, kind in zip(run.k, run.k_types, strict=True))
        mine = seq_cells.parse(seq.save(), seq.id)
        seq.load(seq_cells.write(mine.join(dataclasses.replace(
            run, positions=np.arange(dst, dst + n, dtype=np.int32), k=k))))
        return sum(x.nbytes for x in (*run.k, *run.v))
