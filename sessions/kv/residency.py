"""Where sessions' KV lives, and the model-thread half of a turn.

Both models' contexts hold up to ``slots`` sessions' KV at once
(:class:`SlotTable`), and their turns run together in the step loop.  A turn for
a session that is not resident takes a free slot or the least recently used idle
one, whose KV is saved into :class:`ParkedKV` (RAM under a budget, LRU, optional
disk spill); a session whose KV was dropped rebuilds it from its tokens on its
next turn.  A session without KV starts from a shared prefix: the longest dense
one an idle resident session of its owner holds, or the owner's cached system
prompt (:class:`PrefixCache`).  Everything here runs on the model thread only:
inside the turns, and in the jobs that deletes, expiry and moves queue there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import structlog

from core.errors import EngineError, TurnCancelled
from core.kv.positions import SessionKV, dense_prefix, speculator_backlog
from core.kv.reuse import find_run
from core.prompt import Prompt
from core.results import Result, Timings
from core.steps import Tokens, TurnSteps, Wait
from core.turn_request import TurnRequest
from sessions.kv import held_reply
from sessions.kv.checkpoints import SessionCheckpoints
from sessions.kv.parked import ParkedKV
from sessions.kv.prefixes import PrefixCache
from sessions.kv.slot_table import Seat, SlotTable
from sessions.kv.tier import KVTier
from sessions.session import KVLocation, Session, SessionState

if TYPE_CHECKING:  # the engine runs on the model thread; this module only hands it work
    from core.engine import Engine

log = structlog.get_logger("specgate.sessions")
SPLICE_MAX_GAP = 1024  # new tokens (a task) prefilled before a spliced run, at most


def system_end(prompt: Prompt) -> int:
    """Where the prompt's leading system message (with the tools the template puts there)
    ends; 0 without one."""
    return prompt.spans[0].end if prompt.spans and prompt.spans[0].role == "system" else 0


@dataclass(slots=True)
class TurnOutcome:
    result: Result
    evicted: list[str]  # keys of sessions whose parked KV was evicted to make room for this turn


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

    def account(self, t: Timings) -> None:
        """The engine counts a built prefix as cached (it found it in the slot): it was prefilled."""
        t.prefix_shared_n, t.prefix_built_n, t.prefix_spliced_n = self.shared, self.built, self.spliced
        if self.shared or self.built:
            t.prefix_source, t.prefix_ms, t.prefix_bytes = self.source, self.seconds * 1e3, self.loaded_bytes
        t.cache_n -= self.built + self.gap
        t.speculator_cache_n -= self.built
        t.prompt_n += self.built + self.gap
        t.speculator_prefill_n += self.built
        t.ttft_ms += self.seconds * 1e3


class Residency:
    def __init__(self, slots: int, parked: ParkedKV, prefix_min_tokens: int,
                 holds: Callable[[Session], bool], tier: KVTier | None = None,
                 checkpoint_tokens: int = 0, splice_min_tokens: int = 0, isolate: bool = False) -> None:
        """``holds(session)``: whether the session table still holds that very session (one
        deleted, expired or moved away meanwhile has nothing worth parking).  ``splice_min_tokens``:
        the shortest run past the shared prefix worth moving in from a sibling (0: none).
        ``isolate``: conversations of one key share no more than the system prompt and tools
        (``--isolate-conversations``: many end users behind one key)."""
        self.slots = SlotTable(slots)
        self.parked = parked
        self.prefixes = PrefixCache(parked, prefix_min_tokens, tier)
        self.checkpoints = SessionCheckpoints(tier, checkpoint_tokens) if tier is not None and checkpoint_tokens \
            else None
        self._holds = holds
        self.splice_min_tokens = 0 if isolate else splice_min_tokens
        self.isolate = isolate
        self.spliced = 0  # tokens moved into place from another conversation's KV, not prefilled
        self.splices_skipped = 0  # splices given up: the donor's slot changed while their gap was prefilled
        self.caught_up = 0  # scorer tokens prefilled in idle time
        self.rewritten = 0  # target tokens prefilled in idle time by held replies rewritten

    def location(self, session: Session) -> str:
        """Where the session's KV is (read from the event loop: a snapshot)."""
        if self.slots.find(session) is not None:
            return KVLocation.RESIDENT.value
        where = self.parked.where(session.key)
        if where != "none":
            return where
        return session.kv_location.value

    def _idle_sessions(self) -> list[tuple[int, Session]]:
        """(slot, session) of the resident sessions no turn is using: what idle work may touch."""
        return [(slot, holder) for slot, holder in self.slots.idle()
                if isinstance(holder, Session) and holder.state is SessionState.IDLE]

    def catch_up(self, engine: Engine, max_tokens: int) -> int:
        """Idle time: bring the scorer's KV of the idle resident session furthest behind one
        chunk closer to its target's, so that its next turn scores only its new tokens
        (core.kv.positions.speculator_backlog).  Returns the tokens decoded; 0: nothing to do."""
        best: tuple[int, int, Session] | None = None
        for slot, holder in self._idle_sessions():
            behind = len(speculator_backlog(holder.kv, engine.speculator_ctx.seq(slot).n_ctx - 1)[1])
            if behind and (best is None or behind > best[0]):
                best = (behind, slot, holder)
        if best is None:
            return 0
        _, slot, session = best
        done = engine.slot_kv.catch_up_speculator(session.kv, slot, max_tokens)
        self.caught_up += done
        return done

    def idle(self, engine: Engine, catch_up_tokens: int) -> bool:
        """One piece of idle work: fill or complete a shared prefix's entry (one copy, and the
        tier then serves it to other replicas), else rewrite a held reply that called tools
        in the client's form (sessions.kv.held_reply), else grow the buffers a session's next
        turn copies through (Engine.reserve_buffers), else catch a scorer up, else checkpoint
        a session; False: none.  ``catch_up_tokens`` bounds one idle prefill (0: none)."""
        if self.complete_prefix(engine):
            return True
        if catch_up_tokens > 0:
            rewritten = held_reply.rewrite_one(engine, self._idle_sessions(), catch_up_tokens)
            if rewritten is not None:
                self.rewritten += rewritten
                return True
        if any(engine.reserve_buffers(slot) for slot, _ in self._idle_sessions()):
            return True
        if catch_up_tokens > 0 and self.catch_up(engine, catch_up_tokens) > 0:
            return True
        return self.checkpoint(engine)

    def complete_prefix(self, engine: Engine) -> bool:
        """Idle time: copy a wanted shared prefix's entry from an idle resident session of its
        owner that holds it (a sibling conversation adopted it from there, and left the copy
        for now, off its reply path); else give an entry kept without the speculator's part
        (copied from a session whose scorer the tool guard deferred) that part, from a session
        whose scorer has caught up past it.  Sessions started from the entry then hold the
        prefix in both models, so their scorer lags by their own tokens only, and a later turn
        can score just its new ones (issue 41)."""
        for pending, with_scorer in ((self.prefixes.unfilled, False), (self.prefixes.lacking, True)):
            for key, (owner, tokens) in list(pending.items()):
                for slot, holder in self._idle_sessions():
                    blobs = engine.slot_kv.cut_prefix(tokens, slot, holder.kv, with_scorer) \
                        if holder.owner == owner else None
                    if blobs is None:
                        continue
                    evicted = self.prefixes.complete(key, blobs) if with_scorer \
                        else self.prefixes.fill(key, owner, tokens, blobs)
                    log.info("prefix_completed" if with_scorer else "prefix_cached", tokens=len(tokens),
                             copied_from=holder.id, with_scorer=bool(blobs[1]), evicted=len(evicted))
                    return True
        return False

    def settle(self, engine: Engine, deadline: float) -> tuple[int, int]:
        """Drain, before the process stops: what idle work still owes the tier -- the wanted
        prefix entries idle sessions hold, then a checkpoint of each idle session due one --
        done while ``deadline`` (``time.monotonic()``) allows.  Returns (entries queued for
        the tier, entries left for lack of time)."""
        done = 0
        while time.monotonic() < deadline and (self.complete_prefix(engine) or self.checkpoint(engine)):
            done += 1
        return done, self._owed()

    def _owed(self) -> int:
        idle = self._idle_sessions()
        # an entry lacking only the scorer's part is there: it is completed once a scorer catches up
        prefixes = sum(any(holder.owner == owner for _, holder in idle) for owner, _ in self.prefixes.unfilled.values())
        due = sum(self.checkpoints.due(holder.key, n) and n == len(holder.kv.target.tokens)
                  for _, holder in idle if (n := dense_prefix(holder.kv.target, holder.kv.target.tokens)))  \
            if self.checkpoints is not None else 0
        return prefixes + due

    def checkpoint(self, engine: Engine) -> bool:
        """Idle time: save the KV of one idle resident session that has grown since its last
        checkpoint into the KV tier (sessions.kv.checkpoints), so that a replica taking it
        over, or this one after a restart, restores it.  Only a session whose target holds
        all its tokens densely (no SpecPrefill gaps) is saved whole; its scorer's part goes
        along when it holds the same tokens.  One save is a copy of the session's KV on the
        model thread: a turn that arrives waits for it (tens of ms per 1K tokens)."""
        if self.checkpoints is None:
            return False
        for slot, holder in self._idle_sessions():
            tokens = tuple(holder.kv.target.tokens)
            n = dense_prefix(holder.kv.target, tokens)
            if n != len(tokens) or not self.checkpoints.due(holder.key, n):
                continue
            with_scorer = dense_prefix(holder.kv.speculator, tokens) == n == len(holder.kv.speculator.tokens)
            if self.checkpoints.write(holder.key, holder.owner, tokens, engine.slot_kv.save(slot, with_scorer)):
                log.info("session_checkpointed", session_id=holder.id, tokens=n, with_scorer=with_scorer)
                return True
        return False

    def forget_kv(self, engine: Engine, session: Session) -> None:
        """A running turn keeps its slot until it ends; it then gives the slot up (see
        :meth:`session_turn`).  A deleted session's checkpoint goes too."""
        if (slot := self.slots.evict(session)) is not None:
            engine.slot_kv.load(None, slot)
        self.parked.discard(session.key)
        if self.checkpoints is not None and session.state is SessionState.DELETED:
            self.checkpoints.forget(session.key, session.owner)

    def _park(self, engine: Engine, seat: Seat) -> list[str]:
        """Save the KV of the idle session ``seat`` displaced (model thread only); returns
        the keys whose parked KV was evicted to make room."""
        victim = seat.displaced
        if not isinstance(victim, Session) or victim.state is SessionState.DELETED or not self._holds(victim):
            return []  # deleted, expired or moved away: nothing to keep
        evicted = self.parked.put(victim.key, engine.slot_kv.save(seat.slot))  # deleted meanwhile: its drop follows
        for key in evicted:
            log.info("session_kv_evicted", session_key=key, spilled=self.parked.where(key) == "disk")
        return evicted

    def stateless(self, engine: Engine, work: TurnRequest) -> TurnSteps[TurnOutcome]:
        if work.cancel.is_set():
            raise TurnCancelled("the client left before the turn started")
        prompt = work.render(engine)
        engine.check_turn(prompt, work.params)  # before another session's KV is disturbed
        seat = self.slots.seat(object())
        evicted = self._park(engine, seat)
        kv, start = SessionKV(), PrefixStart()
        try:
            engine.slot_kv.load(None, seat.slot)
            start = yield from self._start_from_prefix(engine, work.owner, kv, prompt, seat.slot)
            evicted += start.evicted
            result = yield from engine.turn(prompt, work.params, work.sink, kv=kv, slot=seat.slot)
        finally:
            self.slots.release(seat.slot, keep=False)
        start.account(result.timings)
        return TurnOutcome(result, evicted)

    def session_turn(self, engine: Engine, session: Session, work: TurnRequest) -> TurnSteps[TurnOutcome]:
        if work.cancel.is_set():
            raise TurnCancelled("the turn was cancelled before it started")
        prompt = work.render(engine)
        engine.check_turn(prompt, work.params)  # a bad request must not cost the session its cache
        seat = self.slots.seat(session)
        evicted = self._park(engine, seat)
        rebuilt, start = False, PrefixStart()
        try:
            if seat.fresh:
                blobs = self.parked.take(session.key)
                if blobs is None and session.turns:
                    # dropped under the budget, failed its checks, or hydrated from the store: rebuild
                    session.kv.reset()
                    session.rebuilds += 1
                    rebuilt = True
                    log.info("session_kv_rebuild", session_id=session.id)
                engine.slot_kv.load(blobs, seat.slot)
                if blobs is None and rebuilt:
                    start = self._from_checkpoint(engine, session, prompt, seat.slot)
                if blobs is None and not start.shared:
                    start = yield from self._start_from_prefix(engine, session.owner, session.kv, prompt, seat.slot)
                    evicted += start.evicted
            result = yield from engine.turn(prompt, work.params, work.sink, kv=session.kv, slot=seat.slot)
        except BaseException:
            # never leave bookkeeping that disagrees with the caches: the next turn rebuilds
            session.kv.reset()
            engine.slot_kv.load(None, seat.slot)
            raise
        finally:
            self.slots.release(seat.slot, keep=session.state is not SessionState.DELETED)
        result.timings.kv_rebuilt = rebuilt
        start.account(result.timings)
        return TurnOutcome(result, evicted)

    def _from_checkpoint(self, engine: Engine, session: Session, prompt: Prompt, slot: int) -> PrefixStart:
        """A session being rebuilt (taken over, restarted, dropped under the budget) starts
        from its checkpoint in the KV tier when the prompt still begins with its tokens."""
        t0, checkpoints = time.perf_counter(), self.checkpoints
        found = checkpoints.find(session.key, session.owner, prompt.tokens) if checkpoints is not None else None
        if checkpoints is None or found is None:
            return PrefixStart()
        held, n, blobs = found
        if not engine.slot_kv.restore_prefix(blobs, prompt.tokens[:n], session.kv, slot, held):
            return PrefixStart()
        checkpoints.restored += 1
        log.info("session_restored_from_checkpoint", session_id=session.id, tokens=n, held=held)
        return PrefixStart(shared=n, seconds=time.perf_counter() - t0, source="checkpoint",
                           loaded_bytes=sum(map(len, blobs)))

    def _start_from_prefix(self, engine: Engine, owner: str, kv: SessionKV, prompt: Prompt,
                           slot: int) -> TurnSteps[PrefixStart]:
        """Start ``kv`` (empty, in ``slot``) from a shared prefix.  Copying comes before
        computing: the longest prefix an idle resident session of the same owner holds densely
        is copied when it covers the system prompt (a sibling conversation, a conversation's
        branch, another agent's history), and a wanted cache entry for the system prompt is
        filled from that copy.  Else the owner's cached system prompt is restored
        (sessions.kv.prefixes), waited for while another turn builds it, or built if it is
        frequent."""
        t0, n = time.perf_counter(), self.prefixes.end(prompt)
        key = self.prefixes.key(owner, prompt.tokens[:n]) if n else ""
        shareable = prompt.tokens[:system_end(prompt) + 1] if self.isolate else prompt.tokens
        donor = self._donor(owner, shareable)
        covered = n > 0 and donor is not None and donor[2] >= n
        if n and not covered and not self.isolate:
            lent = yield from self._from_conversation(engine, owner, kv, prompt.tokens, slot, n)
            if lent is not None:
                lent.seconds = time.perf_counter() - t0
                return lent
        if covered or not n or not self.prefixes.wanted(key):
            if covered:
                self.prefixes.want(key, owner, prompt.tokens[:n])
            shared = self._adopt(engine, kv, shareable, slot, donor)
            spliced, gap = 0, 0
            if shared and donor is not None:
                spliced, gap = yield from self._splice(engine, kv, prompt.tokens, slot, donor[0], donor[1].kv,
                                                       donor[1].id)
            return PrefixStart(shared=shared + spliced, seconds=time.perf_counter() - t0, source="resident",
                               spliced=spliced, gap=gap)
        if self.prefixes.building(key):
            self.prefixes.waits += 1
            yield Wait(lambda: not self.prefixes.building(key))
        blobs, evicted, source = self.prefixes.load(key)
        if blobs is not None:
            if engine.slot_kv.restore_prefix(blobs, prompt.tokens[:n], kv, slot):
                self.prefixes.note(key, owner, prompt.tokens[:n], blobs)
                self.prefixes.hits += 1
                return PrefixStart(shared=n, seconds=time.perf_counter() - t0, evicted=evicted, source=source,
                                   loaded_bytes=sum(map(len, blobs)))
            self.prefixes.forget(key)
            log.warning("prefix_unloadable", tokens=n)
        self.prefixes.misses += 1
        self.prefixes.begin(key)
        blobs = None
        try:
            blobs = yield from engine.slot_kv.prefill_prefix(prompt.tokens[:n], kv, slot)
        finally:
            evicted += self.prefixes.finish(key, blobs)
        log.info("prefix_cached", tokens=n)
        return PrefixStart(built=n, seconds=time.perf_counter() - t0, evicted=evicted, source="built")

    def _donor(self, owner: str, tokens: tuple[int, ...]) -> tuple[int, Session, int] | None:
        """(slot, session, tokens) of the idle resident session of ``owner`` that holds the
        longest prefix of ``tokens`` densely (what can be copied as is)."""
        best: tuple[int, Session, int] | None = None
        for donor_slot, holder in self.slots.idle():
            if isinstance(holder, Session) and holder.owner == owner:
                n = dense_prefix(holder.kv.target, tokens)
                if n > (best[2] if best else 0):
                    best = (donor_slot, holder, n)
        return best

    def _from_conversation(self, engine: Engine, owner: str, kv: SessionKV, tokens: tuple[int, ...], slot: int,
                           n: int) -> TurnSteps[PrefixStart | None]:
        """No idle session here holds the prompt's system prompt (a replica that never saw this
        agent, a restart): the owner's checkpointed conversation in the KV tier that shares the
        most with the prompt (sessions.kv.checkpoints) is loaded into a free slot and lends
        its KV as a resident one would: its prefix, and a block repeated after a different
        task.  The slot is a free one, else the least recently used idle one, whose session is
        parked first.  None when no checkpoint gives more than the ``n``-token system prompt's
        own entry would, or every other slot runs a turn."""
        checkpoints = self.checkpoints
        if checkpoints is None or self.slots.busy >= len(self.slots):  # every other slot runs a turn
            return None
        best = checkpoints.best_lender(owner, tokens, n, self.splice_min_tokens, SPLICE_MAX_GAP)
        blobs = checkpoints.tier.get(best[1]) if best is not None else None
        if best is None or blobs is None:
            return None
        lender_seat = object()  # holds the slot while the checkpoint lends from it
        seat = self.slots.seat(lender_seat)  # a free slot, else the least recently used idle one, parked
        lend, evicted = seat.slot, self._park(engine, seat)
        try:
            lender = SessionKV()
            if not engine.slot_kv.restore_prefix(blobs, best[0], lender, lend):
                log.warning("checkpoint_unloadable", tokens=len(best[0]))
                return PrefixStart(evicted=evicted)  # the turn prefills it all; the entry ages out
            shared = engine.slot_kv.adopt_prefix(tokens, kv, slot, lender, lend)
            # idle while the gap before a spliced run is prefilled: another turn may take it
            # (every running turn must find a slot), and the splice then finds it changed
            self.slots.release(lend)
            spliced, gap = yield from self._splice(engine, kv, tokens, slot, lend, lender, "checkpoint")
        finally:
            if (mine := self.slots.find(lender_seat)) is not None:  # not taken meanwhile: emptied, freed
                engine.slot_kv.load(None, mine)
                self.slots.release(mine, keep=False)
        checkpoints.lent += 1
        log.info("prefix_lent_by_checkpoint", tokens=shared + spliced, spliced=spliced)
        return PrefixStart(shared=shared + spliced, source="conversation", loaded_bytes=sum(map(len, blobs)),
                           spliced=spliced, gap=gap, evicted=evicted)

    def _splice(self, engine: Engine, kv: SessionKV, tokens: tuple[int, ...], slot: int,
                donor_slot: int, donor: SessionKV, donor_id: str) -> TurnSteps[tuple[int, int]]:
        """Past the adopted prefix, a run the donor holds further on (a sibling conversation's
        repeated block after its own task, core.kv.reuse) is moved into this prompt's place in
        the target: the tokens before it are prefilled first, then its cells spliced in
        (SlotKV.splice).  The scorer is left behind there, to catch up later.  Returns
        (tokens spliced, tokens prefilled before them)."""
        if not self.splice_min_tokens:
            return 0, 0
        start = len(kv.target.tokens)
        found = find_run(tokens[:-1], start, donor.target.tokens, donor.target.kv_pos, self.splice_min_tokens,
                         SPLICE_MAX_GAP)
        if found is None:
            return 0, 0
        k, j, n = found
        if k > start:
            stamp = self.slots.stamp(donor_slot)
            yield Tokens(engine.target_ctx.seq(slot), tokens[start:k], start, logits=False)
            kv.target.extend(tokens[start:k], range(start, k))
            if not self.slots.unchanged(donor_slot, stamp):  # other turns ran: it may hold another key's KV
                self.splices_skipped += 1
                log.info("kv_splice_skipped", donor=donor_id, reason="the donor's slot changed during the gap")
                return 0, k - start
        try:
            engine.slot_kv.splice(slot, donor_slot, j, k, n)
        except EngineError as exc:  # a model whose K cannot be moved, an unexpected state layout
            log.warning("kv_splice_failed", error=str(exc))
            return 0, k - start
        kv.target.extend(tokens[k:k + n], range(k, k + n))
        self.spliced += n
        log.info("kv_spliced", donor=donor_id, tokens=n, moved_by=k - j, prefilled_before=k - start)
        return n, k - start

    def _adopt(self, engine: Engine, kv: SessionKV, tokens: tuple[int, ...], slot: int,
               donor: tuple[int, Session, int] | None) -> int:
        if donor is None:
            return 0
        donor_slot, holder, _ = donor
        shared = engine.slot_kv.adopt_prefix(tokens, kv, slot, holder.kv, donor_slot)
        if shared:
            self.prefixes.adopted += 1
            log.info("session_prefix_shared", session_id=holder.id, tokens=shared, donor_slot=donor_slot)
        return shared
