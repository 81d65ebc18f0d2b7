"""The session manager: the session table, and turns.

Sessions are found by ``(owner, id)`` (:mod:`sessions.session`), so another
key's session looks exactly like an unknown one; a request that names no
session continues the conversation its tokens match
(:class:`~sessions.conversations.ImplicitSessions`).  The table holds each
session's lifecycle, lease (:mod:`sessions.registry`), TTL and record: the
metadata and full history go to the store (Redis) through the
:class:`StoreWriter`, off the reply path.  Where each session's KV lives is the
model thread's business (:class:`~core.runtime.residency.Residency`); the table
hands it plain messages (core.runtime.messages): a turn to run, a session's KV to drop.

One turn per session at a time: a second concurrent turn gets 409.  Delete
wins over a running turn: it cancels it, and nothing written afterwards
brings the session back.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from typing import Any

import structlog

from core.config import DEFAULT_LIMITS, Limits
from core.errors import (
    InvalidRequest,
    OwnedElsewhere,
    SessionBusy,
    SessionLimit,
    SessionNotFound,
    StoreUnavailable,
)
from core.kv.slot_table import SlotTable
from core.prompt import Prompt
from core.runtime.messages import Forget, Render, RunTurn, Settle
from core.runtime.residency import Residency
from core.runtime.seating import TurnOutcome
from core.runtime.worker import ModelState, ModelWorker
from core.turn_request import TurnRequest
from sessions.admission import FairAdmission
from sessions.conversations import ImplicitSessions
from sessions.ids import check_id, session_key
from sessions.kv.checkpoints import SessionCheckpoints
from sessions.kv.parked import ParkedKV
from sessions.kv.prefixes import PrefixCache
from sessions.kv.tier import KVTier
from sessions.metadata import MetadataStore
from sessions.registry import LocalRegistry, Registry
from sessions.session import IMPLICIT_PREFIX, KVLocation, Session, SessionState
from sessions.store_writer import StoreWriter

__all__ = ["IMPLICIT_PREFIX", "Session", "SessionManager", "SessionState", "TurnOutcome"]
log = structlog.get_logger("specgate.sessions")


class SessionManager:
    def __init__(self, worker: ModelWorker, store: MetadataStore, parked: ParkedKV, admission: FairAdmission,
                 writer: StoreWriter, limits: Limits = DEFAULT_LIMITS, ttl_s: float = 86400,
                 registry: Registry | None = None, prefix_min_tokens: int = 256,
                 implicit_min_share: float = 0.5, tier: KVTier | None = None,
                 checkpoint_tokens: int = 0, splice_min_tokens: int = 0, isolate_conversations: bool = False) -> None:
        self.worker = worker
        self.store = store
        self.parked = parked
        self.admission = admission
        self.writer = writer
        self.limits = limits
        self.ttl_s = ttl_s
        self.registry: Registry = registry or LocalRegistry()
        self._sessions: dict[str, Session] = {}
        self._prefixes = PrefixCache(parked, prefix_min_tokens, tier)
        checkpoints = SessionCheckpoints(tier, checkpoint_tokens) if tier is not None and checkpoint_tokens else None
        self.residency = Residency(worker.config.slots, parked, self._prefixes,
                                   checkpoints, splice_min_tokens, isolate_conversations)  # model thread
        self.implicit = ImplicitSessions(implicit_min_share)  # event loop only

    @property
    def live(self) -> int:
        return len(self._sessions)

    @property
    def running(self) -> int:
        return sum(s.state is SessionState.RUNNING for s in self._sessions.values())

    def held(self) -> list[str]:
        """Keys of the sessions this replica keeps (their leases are renewed)."""
        return list(self._sessions)

    def forget(self, keys: list[str]) -> None:
        """Leases another replica took: drop those sessions here (a running turn finishes, and
        the store refuses its write)."""
        for key in keys:
            session = self._sessions.get(key)
            if session is not None and session.state is SessionState.IDLE:
                del self._sessions[key]
                self._drop_kv(session)
                self.implicit.remove(key)
                log.info("session_moved_away", session_key=key)

    async def _own(self, key: str, session_id: str, creating: bool = False) -> None:
        """Hold ``key``'s lease, or :class:`OwnedElsewhere` naming the live owner.

        A session this replica keeps is served without asking Redis: its lease is renewed
        every second, and one another replica takes is reported by the renewal (``forget``),
        so a hung Redis never sits on the reply path."""
        if key in self._sessions:
            return
        try:
            holder = await self.registry.claim(key)
        except StoreUnavailable:
            if creating:  # a new session: nobody else can have it; the registry catches up
                return
            raise
        if holder is not None:
            raise OwnedElsewhere(session_id, key, holder)

    # -- lifecycle -------------------------------------------------------------
    async def create(self, owner: str, session_id: str | None = None, implicit: bool = False) -> Session:
        """``implicit``: a session the server made for the caller (it goes first when room is short)."""
        sid = check_id(session_id) if session_id is not None else f"sess-{uuid.uuid4().hex[:20]}"
        await self._own(session_key(owner, sid), sid, creating=True)
        if session_id is not None and not implicit and await self.exists(owner, sid):
            raise InvalidRequest(f"session {sid!r} already exists")
        self._admit(owner)
        session = self._sessions.setdefault(session_key(owner, sid), Session(id=sid, owner=owner, implicit=implicit))
        self.mirror(session)
        log.info("session_created", session_id=sid)
        return session

    def _admit(self, owner: str) -> None:
        """Room for one more session, or :class:`SessionLimit` naming the cap.  Implicit
        sessions make room first: the least recently used idle one (the owner's, at the
        per-key cap) is dropped, so server-made sessions never cost a client a 429."""
        if len(self._sessions) >= self.limits.max_sessions:
            self.sweep()
        if len(self._sessions) >= self.limits.max_sessions:
            self._evict_implicit(None)
        if sum(s.owner == owner for s in self._sessions.values()) >= self.limits.max_sessions_per_key:
            self._evict_implicit(owner)
        if len(self._sessions) >= self.limits.max_sessions:
            raise SessionLimit(f"this server holds its limit of {self.limits.max_sessions} sessions; "
                               "delete idle sessions or retry later")
        if sum(s.owner == owner for s in self._sessions.values()) >= self.limits.max_sessions_per_key:
            raise SessionLimit(f"this API key holds its limit of {self.limits.max_sessions_per_key} sessions; "
                               "delete some first")

    def _evict_implicit(self, owner: str | None) -> None:
        victim = self.implicit.victim(self._sessions.values(), owner)
        if victim is not None:
            del self._sessions[victim.key]
            victim.state = SessionState.DELETED
            self._drop_kv(victim)
            self.implicit.remove(victim.key)
            self.writer.delete(victim.key)
            log.info("implicit_session_evicted", session_key=victim.key)

    async def get_or_create(self, owner: str, session_id: str) -> Session:
        """The session named ``session_id``, created on first use (clients that speak only
        the OpenAI API cannot call ``POST /v1/sessions`` first)."""
        try:
            return await self.get(owner, session_id)
        except SessionNotFound:
            return await self.create(owner, session_id)

    async def get(self, owner: str, session_id: str) -> Session:
        key = session_key(owner, check_id(session_id))
        await self._own(key, session_id)
        session = self._sessions.get(key)
        if session is not None:
            return session
        rec = await self.writer.load(key)
        if rec is None or rec.get("owner") != owner:
            raise SessionNotFound(f"unknown session {session_id!r}")
        self._admit(owner)
        session = self._sessions.setdefault(key, Session.from_record(rec))
        log.info("session_hydrated", session_id=session_id, turns=session.turns, messages=len(session.messages))
        return session

    async def exists(self, owner: str, session_id: str) -> bool:
        key = session_key(owner, session_id)
        return key in self._sessions or await self.writer.load(key) is not None

    async def delete(self, owner: str, session_id: str) -> None:
        """Delete wins: a running turn is cancelled and its result is not recorded; the
        store delete is queued behind nothing (replayed if the store is down)."""
        key = session_key(owner, check_id(session_id))
        await self._own(key, session_id)
        local = self._sessions.pop(key, None)
        if local is None and await self.writer.load(key) is None:
            raise SessionNotFound(f"unknown session {session_id!r}")
        self.implicit.remove(key)
        if local is not None:
            local.state = SessionState.DELETED
            if local.cancel is not None:
                local.cancel.set()
            self._drop_kv(local)
        self.writer.delete(key)
        log.info("session_deleted", session_id=session_id)

    def mirror(self, session: Session) -> None:
        """Queue the session's record for the store (see :class:`StoreWriter`)."""
        if session.state is not SessionState.DELETED:
            session.version += 1
            self.writer.save(session.key, session.record())

    def expect_resend(self, session: Session, tools: Sequence[dict[str, Any]] | None) -> None:
        """The session's last reply called tools: idle work rewrites the reply it holds in the
        form the client will resend it (sessions.kv.held_reply)."""
        session.resend_tools = tuple(tools or ())
        self.worker.wake()

    def sweep(self, now: float | None = None) -> int:
        """Forget sessions idle past the TTL (their store records expire on their own)."""
        cutoff = (now or time.time()) - self.ttl_s
        stale = [k for k, s in self._sessions.items() if s.state is SessionState.IDLE and s.last_active < cutoff]
        for key in stale:
            self._drop_kv(self._sessions.pop(key))
            self.implicit.remove(key)
        if stale:
            log.info("sessions_expired", n=len(stale))
        return len(stale)

    def location(self, session: Session) -> str:
        """Where the session's KV is (a snapshot of the model thread's slot table)."""
        if self.residency.slots.find(session) is not None:
            return KVLocation.RESIDENT.value
        where = self.parked.where(session.key)
        return where if where != "none" else session.kv_location.value

    @property
    def slots(self) -> SlotTable:
        return self.residency.slots

    @property
    def prefixes(self) -> PrefixCache:
        return self._prefixes

    # -- conversations found by their tokens ---------------------------------------
    def continuing(self, owner: str, tokens: Sequence[int], hint: str | None = None) -> Session | None:
        """The idle implicit session ``tokens`` continue (:meth:`ImplicitSessions.continuing`)."""
        return self.implicit.continuing(self._sessions, owner, tokens, hint)

    async def start_implicit(self, owner: str, required: bool = False, hint: str | None = None) -> Session | None:
        """A new implicit session for a conversation nobody holds.  When the owner has no
        room left: None (the turn runs stateless: a request never fails for it), or
        :class:`SessionLimit` if the caller ``required`` one (a response to store)."""
        try:
            session = await self.create(owner, f"{IMPLICIT_PREFIX}{uuid.uuid4().hex[:20]}", implicit=True)
        except SessionLimit:
            if required:
                raise
            return None
        session.hint = hint
        return session

    @property
    def implicit_live(self) -> int:
        return sum(s.implicit for s in self._sessions.values())

    # -- turns -----------------------------------------------------------------
    def claim(self, session: Session, cancel: threading.Event, request_id: str | None = None) -> None:
        """Mark the session's one running turn (synchronously: no await between check and set)."""
        self.check_free(session)
        session.state, session.cancel, session.request_id = SessionState.RUNNING, cancel, request_id

    def check_free(self, session: Session, request_id: str | None = None) -> None:
        """Refuse a turn on a deleted or busy session -- before any model-thread work for it.  A
        busy session running an earlier copy of ``request_id`` passes (see :meth:`replace_replayed`)."""
        if session.state is SessionState.DELETED:
            raise SessionNotFound(f"unknown session {session.id!r}")
        if session.state is SessionState.RUNNING and (request_id is None or session.request_id != request_id):
            raise SessionBusy(f"session {session.id!r} already has a turn running; wait for it or cancel it")

    async def replace_replayed(self, session: Session, request_id: str | None, timeout_s: float = 30.0) -> bool:
        """The running turn is an earlier copy of request ``request_id`` (a balancer replayed
        it after the replica relaying the first copy died, so nobody reads the first): cancel
        it and wait until the session is free.  False when it is another request's turn."""
        if request_id is None or session.request_id != request_id or session.state is not SessionState.RUNNING:
            return False
        if session.cancel is not None:
            session.cancel.set()
        deadline = time.monotonic() + timeout_s
        while session.state is SessionState.RUNNING and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        log.info("replayed_turn_replaced", session_id=session.id, request_id=request_id)
        return session.state is SessionState.IDLE

    def release(self, session: Session) -> None:
        if session.state is SessionState.RUNNING:
            session.state = SessionState.IDLE
            self.worker.wake()  # its scorer to catch up, its KV to checkpoint
        session.cancel = None
        session.request_id = None

    async def render(self, work: TurnRequest, check: bool = True) -> Prompt:
        """The turn's prompt, rendered on the model thread, and with ``check`` checked against
        the context (:class:`PromptTooLong`, :class:`EmptyPrompt`), so a request that cannot
        run is refused before any response starts; the turn then runs this prompt
        (``work.prompt``).  The one way to render or count a request's tokens."""
        async with self.admission.side_call():  # bounded: a flood is a 429, not a stall
            prompt: Prompt = await self.worker.call(Render(work, check))
            return prompt

    def admit(self) -> None:
        """Room in the turn queue for one more turn, or :class:`QueueFull` (before any work)."""
        self.admission.admit()

    async def run_turn(self, session: Session | None, work: TurnRequest) -> TurnOutcome:
        """Run ``work`` in ``session`` (which must have been :meth:`claim`-ed), or without one."""
        if session is None:
            return await self.admission.submit(f"stateless-{work.id}", lambda: self.worker.turn(RunTurn(work)))
        try:
            outcome: TurnOutcome = await self.admission.submit(session.key,
                                                               lambda: self.worker.turn(RunTurn(work, session)))
        finally:
            self.implicit.held(session)
        self._record(session, outcome)
        return outcome

    def _record(self, session: Session, outcome: TurnOutcome) -> None:
        t = outcome.result.timings
        session.turns += 1
        session.last_active = time.time()
        session.prompt_tokens += t.context_n
        session.completion_tokens += t.predicted_n
        session.context_tokens = len(session.kv.target.tokens)
        session.last_status, session.last_ttft_ms = t.specprefill, round(t.ttft_ms, 1)
        session.last_kept_ratio = round(t.kept_pct / 100.0, 4)
        session.last_prompt_n = t.context_n
        session.kv_location = KVLocation.RESIDENT
        if session.implicit:
            self.implicit.reused += t.cache_n
        for key in outcome.evicted:
            if (victim := self._sessions.get(key)) is not None:
                spilled = self.parked.where(key) == "disk"
                victim.kv_location = KVLocation.DISK if spilled else KVLocation.EVICTED
                if not spilled:
                    self.implicit.remove(key)  # its next turn rebuilds: nothing to reuse

    def _drop_kv(self, session: Session) -> None:
        """Queue the removal of a session's KV -- resident, parked or spilled -- for the model
        thread, which alone changes slots and parked KV: a turn queued later (the same id
        created again) runs after it and finds nothing.  Marked dropped at once, so the model
        thread parks nothing of it meanwhile."""
        session.dropped = True
        self.worker.post(Forget(session))

    # -- what the gateway reports of the layer -----------------------------------
    @property
    def models_ready(self) -> bool:
        return self.worker.state is ModelState.READY

    async def readiness(self, ping_timeout_s: float = 1.0) -> dict[str, Any]:
        """The models' state, the store's, and the turn queue (``/ready``).  A store that is
        down leaves the layer serving: records are buffered and replayed (``degraded``)."""
        try:
            store_ok = await asyncio.wait_for(self.store.ping(), ping_timeout_s)
        except TimeoutError:
            store_ok = False
        return {"models": self.worker.state.value, "store": self.store.kind, "store_reachable": store_ok,
                "degraded": not store_ok or self.writer.degraded, "queue_depth": self.admission.depth}

    def store_view(self) -> dict[str, Any]:
        """Which store keeps the records, and whether every write has landed."""
        return {"store": self.store.kind, "store_synced": not self.writer.degraded}

    async def stored(self, session: Session, wait_s: float) -> bool:
        """Whether ``session``'s record has landed in the store, waiting up to ``wait_s``."""
        return await self.writer.landed(session.key, wait_s)

    async def owner_address(self, replica_id: str) -> str | None:
        """Where the replica that holds a session's lease answers (None: not registered)."""
        return await self.registry.address(replica_id)

    async def take_over(self, key: str, replica_id: str) -> bool:
        """Take ``key``'s lease from ``replica_id``, which did not answer."""
        return await self.registry.take_over(key, replica_id)

    async def settle_kv(self, timeout_s: float) -> dict[str, Any]:
        """Drain: idle work stops, and what it still owed the KV tier (wanted prefix entries,
        checkpoints of idle sessions) is done and written within ``timeout_s``, so a restart
        finds it.  Returns what was queued, what was left for lack of time, whether the queued
        writes ran (``kv_writes_landed``) and how many of them failed."""
        deadline = time.monotonic() + timeout_s
        self.worker.idle_enabled = False
        tier = self.prefixes.tier
        if tier is None or not self.models_ready:
            return {}
        failed = tier.write_failures
        queued, left = await self.worker.call(Settle(deadline))
        landed = await asyncio.to_thread(tier.flush, max(0.0, deadline - time.monotonic()))
        return {"kv_saved": queued, "kv_left": left, "kv_writes_landed": landed,
                "kv_writes_failed": tier.write_failures - failed,
                "kv_writes_waiting_mb": round(tier.queued_bytes / 2**20, 1)}

    async def hand_over(self, flush_timeout_s: float) -> tuple[bool, int]:
        """Drain: flush the records, stop renewing leases, release them for other replicas.
        Returns (all records flushed, leases released)."""
        flushed = await self.writer.flush(flush_timeout_s)
        await self.registry.stop()  # first: a renewal after the release would claim the leases again
        return flushed, await self.registry.release(self.held())

    def figures(self) -> dict[str, float]:
        """The layer's levels and totals, read at scrape time (gateway/metrics.py names them)."""
        steps, parked, prefixes, slots = self.worker.stats, self.parked, self.prefixes, self.slots
        checkpoints = self.residency.checkpoints
        return {
            "sessions": self.live, "implicit_sessions": self.implicit_live, "queue_depth": self.admission.depth,
            "slots_busy": slots.busy, "slots_resident": slots.resident, "last_batch_rows": steps.last_rows,
            "steps": steps.steps, "batches": steps.batches, "batch_rows": steps.batch_rows,
            "batch_tokens": steps.batch_tokens, "chunk_stalls": steps.chunk_stalls,
            "stall_tokens": steps.stall_tokens,
            "kv_ram": parked.bytes_in_ram, "kv_disk": parked.bytes_on_disk, "kv_evictions": parked.evictions,
            "spill_writes": parked.spill_writes, "spill_failures": parked.spill_failures,
            "spill_rejected": parked.spill_rejected,
            "prefix_hits": prefixes.hits, "prefix_misses": prefixes.misses, "prefix_waits": prefixes.waits,
            "prefix_adopted": prefixes.adopted, "prefix_copied": prefixes.copied,
            "prefix_completed": prefixes.completed,
            "caught_up": self.residency.caught_up, "held_rewritten": self.residency.rewritten,
            "idle_chunks": steps.idle_chunks,
            "tier_hits": prefixes.tier_hits, "tier_writes": prefixes.tier.writes if prefixes.tier else 0,
            "tier_rejected": prefixes.tier.rejected if prefixes.tier else 0,
            "tier_bytes": prefixes.tier.bytes_used if prefixes.tier else 0,
            "checkpoints_written": checkpoints.written if checkpoints else 0,
            "checkpoints_restored": checkpoints.restored if checkpoints else 0,
            "checkpoints_lent": checkpoints.lent if checkpoints else 0, "spliced": self.residency.spliced,
            "implicit_hits": self.implicit.hits, "implicit_misses": self.implicit.misses,
            "implicit_reused": self.implicit.reused,
            "store_pending": self.writer.pending, "store_degraded": int(self.writer.degraded),
            "store_errors": self.writer.failed_writes, "store_rejected": self.writer.rejected_writes,
            "store_dropped": self.writer.dropped_writes,
        }
