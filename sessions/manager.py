"""The session manager: session lifecycle, KV residency, and turns.

Sessions are namespaced by owner (the API key that created them): a session
is found by ``(owner, id)``, so another key's session looks exactly like an
unknown one.  Both models' contexts hold up to ``slots`` sessions' KV at
once (:class:`SlotTable`), and their turns run together in the step loop.  A
turn for a session that is not resident takes a free slot or the least
recently used idle one, whose KV is saved into :class:`ParkedKV` (RAM under a
budget, LRU, optional disk spill); a session whose KV was dropped rebuilds it
from its tokens on its next turn.  The slot table and the parked KV change
only on the model thread: inside the turns, and in the jobs that deletes,
expiry and moves queue there (:meth:`SessionManager._drop_kv`).  Each
session's record -- metadata and full history -- goes to the store (Redis)
through the :class:`StoreWriter`, off the reply path.

One turn per session at a time: a second concurrent turn gets 409.  Delete
wins over a running turn: it cancels it, and nothing written afterwards
brings the session back.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from core.config import DEFAULT_LIMITS, Limits, TurnParams
from core.decode import OnText
from core.engine import Engine, Result
from core.errors import (
    InvalidRequest,
    OwnedElsewhere,
    SessionBusy,
    SessionLimit,
    SessionNotFound,
    StoreUnavailable,
    TurnCancelled,
)
from core.prompt import Prompt
from core.results import Timings
from core.session_kv import SessionKV, common_prefix, dense_prefix
from core.steps import TurnSteps, Wait
from core.worker import ModelWorker
from sessions.admission import FairAdmission
from sessions.conversations import ConversationIndex
from sessions.ids import check_id, session_key
from sessions.metadata import MetadataStore
from sessions.parked_kv import ParkedKV
from sessions.prefix_cache import PrefixCache
from sessions.registry import LocalRegistry, Registry
from sessions.slots import Seat, SlotTable
from sessions.store_writer import StoreWriter

log = structlog.get_logger("specgate.sessions")
Render = Callable[[Engine], Prompt]  # runs on the model thread
IMPLICIT_PREFIX = "conv-"  # the ids of sessions the server makes (20 hex digits follow)


class SessionState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"
    DELETED = "deleted"


class KVLocation(enum.StrEnum):
    NONE = "none"  # nothing cached yet
    RESIDENT = "resident"  # live in the model contexts
    RAM = "ram"
    DISK = "disk"
    EVICTED = "evicted"  # dropped: the next turn rebuilds it


@dataclass(slots=True)
class Session:
    id: str
    owner: str
    created: float = field(default_factory=time.time)
    last_active: float = field(default_factory=time.time)
    state: SessionState = SessionState.IDLE
    kv_location: KVLocation = KVLocation.NONE
    turns: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    context_tokens: int = 0
    last_kept_ratio: float | None = None
    last_status: str | None = None
    last_ttft_ms: float | None = None
    rebuilds: int = 0
    version: int = 0  # of the stored record: every write carries a larger one
    kv: SessionKV = field(default_factory=SessionKV)
    messages: list[dict[str, Any]] = field(default_factory=list)
    cancel: threading.Event | None = None  # the running turn's
    request_id: str | None = None  # the running turn's request (X-Request-Id): a replay of it replaces it
    implicit: bool = False  # made by the server (a conversation found by its tokens, a stored response's), not named
    last_prompt_n: int = 0  # tokens of the last turn's prompt: a request that covers them continues the conversation
    responses: list[dict[str, Any]] = field(default_factory=list)  # stored Responses API answers, newest last

    @property
    def key(self) -> str:
        return session_key(self.owner, self.id)

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "session", "created": int(self.created),
            "last_active": int(self.last_active), "state": self.state.value, "turns": self.turns,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "context_tokens": self.context_tokens, "kept_ratio": self.last_kept_ratio,
            "last_status": self.last_status, "last_ttft_ms": self.last_ttft_ms,
            "kv": self.kv_location.value, "rebuilds": self.rebuilds, "messages": len(self.messages),
            "target_cached_tokens": self.kv.target.n_cached, "speculator_cached_tokens": self.kv.speculator.n_cached,
            "implicit": self.implicit,
        }

    def record(self) -> dict[str, Any]:
        """What the store keeps: the metadata, the owner and the full history."""
        return {**self.meta(), "state": SessionState.IDLE.value, "owner": self.owner, "history": self.messages,
                "version": self.version, "responses": self.responses}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Session:
        """A session known only from the store (restart, other replica): its KV rebuilds."""
        s = cls(id=rec["id"], owner=rec["owner"], created=rec.get("created", time.time()),
                last_active=rec.get("last_active", time.time()))
        s.turns = int(rec.get("turns", 0))
        s.prompt_tokens = int(rec.get("prompt_tokens", 0))
        s.completion_tokens = int(rec.get("completion_tokens", 0))
        s.last_status, s.last_ttft_ms = rec.get("last_status"), rec.get("last_ttft_ms")
        s.kv_location = KVLocation.EVICTED if s.turns else KVLocation.NONE
        s.rebuilds = int(rec.get("rebuilds", 0))
        s.messages = list(rec.get("history") or [])
        s.version = int(rec.get("version", 0))
        s.implicit = bool(rec.get("implicit", False))
        s.responses = list(rec.get("responses") or [])
        return s


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

    def account(self, t: Timings) -> None:
        """The engine counts a built prefix as cached (it found it in the slot): it was prefilled."""
        t.prefix_shared_n, t.prefix_built_n = self.shared, self.built
        t.cache_n -= self.built
        t.speculator_cache_n -= self.built
        t.prompt_n += self.built
        t.speculator_prefill_n += self.built
        t.ttft_ms += self.seconds * 1e3


class SessionManager:
    def __init__(self, worker: ModelWorker, store: MetadataStore, parked: ParkedKV, scheduler: FairAdmission,
                 writer: StoreWriter, limits: Limits = DEFAULT_LIMITS, ttl_s: float = 86400,
                 registry: Registry | None = None, prefix_min_tokens: int = 256,
                 implicit_min_share: float = 0.5) -> None:
        self.worker = worker
        self.store = store
        self.parked = parked
        self.scheduler = scheduler
        self.writer = writer
        self.limits = limits
        self.ttl_s = ttl_s
        self.registry: Registry = registry or LocalRegistry()
        self._sessions: dict[str, Session] = {}
        self.slots = SlotTable(worker.config.slots)  # model thread only
        self.prefixes = PrefixCache(parked, prefix_min_tokens)  # model thread only
        self.conversations = ConversationIndex()  # implicit sessions' held tokens (event loop)
        self.implicit_min_share = implicit_min_share
        self.implicit_hits = self.implicit_misses = self.implicit_reused = 0

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
                self.conversations.remove(key)
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
            raise OwnedElsewhere(f"session {session_id!r} is served by replica {holder}", key, holder)

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
        idle = [s for s in self._sessions.values() if s.implicit and s.state is SessionState.IDLE
                and (owner is None or s.owner == owner)]
        if idle:
            victim = min(idle, key=lambda s: s.last_active)
            del self._sessions[victim.key]
            victim.state = SessionState.DELETED
            self._drop_kv(victim)
            self.conversations.remove(victim.key)
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
        self.conversations.remove(key)
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

    def sweep(self, now: float | None = None) -> int:
        """Forget sessions idle past the TTL (their store records expire on their own)."""
        cutoff = (now or time.time()) - self.ttl_s
        stale = [k for k, s in self._sessions.items() if s.state is SessionState.IDLE and s.last_active < cutoff]
        for key in stale:
            self._drop_kv(self._sessions.pop(key))
            self.conversations.remove(key)
        if stale:
            log.info("sessions_expired", n=len(stale))
        return len(stale)

    def location(self, session: Session) -> str:
        if self.slots.find(session) is not None:
            return KVLocation.RESIDENT.value
        where = self.parked.where(session.key)
        if where != "none":
            return where
        return session.kv_location.value

    # -- conversations found by their tokens ---------------------------------------
    def continuing(self, owner: str, tokens: Sequence[int]) -> Session | None:
        """The idle implicit session of ``owner`` that ``tokens`` continue: they repeat its
        whole last prompt (a branch of it forks instead) and its held tokens cover at least
        ``implicit_min_share`` of them.  A busy holder is passed over, never waited for."""
        for key, _ in self.conversations.lookup(owner, tokens):
            s = self._sessions.get(key)
            if s is None or s.state is not SessionState.IDLE or s.owner != owner:
                continue
            if common_prefix(s.kv.target.tokens, tokens) >= max(s.last_prompt_n,
                                                                self.implicit_min_share * len(tokens)):
                self.implicit_hits += 1
                return s
        self.implicit_misses += 1
        return None

    async def start_implicit(self, owner: str, required: bool = False) -> Session | None:
        """A new implicit session for a conversation nobody holds.  When the owner has no
        room left: None (the turn runs stateless: a request never fails for it), or
        :class:`SessionLimit` if the caller ``required`` one (a response to store)."""
        try:
            return await self.create(owner, f"{IMPLICIT_PREFIX}{uuid.uuid4().hex[:20]}", implicit=True)
        except SessionLimit:
            if required:
                raise
            return None

    @property
    def implicit_live(self) -> int:
        return sum(s.implicit for s in self._sessions.values())

    def _index(self, session: Session) -> None:
        if session.implicit and session.state is not SessionState.DELETED and session.kv.target.tokens:
            self.conversations.put(session.key, session.owner, session.kv.target.tokens)
        else:
            self.conversations.remove(session.key)

    # -- turns -----------------------------------------------------------------
    def claim(self, session: Session, cancel: threading.Event, request_id: str | None = None) -> None:
        """Mark the session's one running turn (synchronously: no await between check and set)."""
        if session.state is SessionState.DELETED:
            raise SessionNotFound(f"unknown session {session.id!r}")
        if session.state is SessionState.RUNNING:
            raise SessionBusy(f"session {session.id!r} already has a turn running; wait for it or cancel it")
        session.state, session.cancel, session.request_id = SessionState.RUNNING, cancel, request_id

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
        session.cancel = None
        session.request_id = None

    async def run_turn(self, session: Session | None, render: Render, params: TurnParams,
                       on_text: OnText | None, key: str, cancel: threading.Event, owner: str) -> TurnOutcome:
        """``session`` must have been :meth:`claim`-ed; ``cancel`` stops prefill between batches."""
        if session is None:
            return await self.scheduler.submit(key, lambda: self.worker.turn(
                lambda engine: self._stateless(engine, owner, render, params, on_text, cancel), cancel.is_set))
        try:
            outcome: TurnOutcome = await self.scheduler.submit(session.key, lambda: self.worker.turn(
                lambda engine: self._session_turn(engine, session, render, params, on_text, cancel), cancel.is_set))
        finally:
            self._index(session)
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
            self.implicit_reused += t.cache_n
        for key in outcome.evicted:
            if (victim := self._sessions.get(key)) is not None:
                spilled = self.parked.where(key) == "disk"
                victim.kv_location = KVLocation.DISK if spilled else KVLocation.EVICTED
                if not spilled:
                    self.conversations.remove(key)  # its next turn rebuilds: nothing to reuse

    def _drop_kv(self, session: Session) -> None:
        """Queue the removal of a session's KV -- resident, parked or spilled -- for the model
        thread, which alone changes slots and parked KV: a turn queued later (the same id
        created again) runs after it and finds nothing."""
        self.worker.post(lambda engine: self._forget_kv(engine, session))

    # -- model thread ------------------------------------------------------------
    def _forget_kv(self, engine: Engine, session: Session) -> None:
        """A running turn keeps its slot until it ends; it then gives the slot up (see
        :meth:`_session_turn`)."""
        if (slot := self.slots.evict(session)) is not None:
            engine.load_kv(None, slot)
        self.parked.discard(session.key)

    def _park(self, engine: Engine, seat: Seat) -> list[str]:
        """Save the KV of the idle session ``seat`` displaced (model thread only); returns
        the keys whose parked KV was evicted to make room."""
        victim = seat.displaced
        if not isinstance(victim, Session) or victim.state is SessionState.DELETED \
                or self._sessions.get(victim.key) is not victim:
            return []  # deleted, expired or moved away: nothing to keep
        evicted = self.parked.put(victim.key, engine.save_kv(seat.slot))  # deleted meanwhile: its drop follows
        for key in evicted:
            log.info("session_kv_evicted", session_key=key, spilled=self.parked.where(key) == "disk")
        return evicted

    def _stateless(self, engine: Engine, owner: str, render: Render, params: TurnParams,
                   on_text: OnText | None, cancel: threading.Event) -> TurnSteps[TurnOutcome]:
        if cancel.is_set():
            raise TurnCancelled("the client left before the turn started")
        prompt = render(engine)
        engine.check_prompt(prompt)  # before another session's KV is disturbed
        seat = self.slots.seat(object())
        evicted = self._park(engine, seat)
        kv, start = SessionKV(), PrefixStart()
        try:
            engine.load_kv(None, seat.slot)
            start = yield from self._start_from_prefix(engine, owner, kv, prompt, seat.slot)
            evicted += start.evicted
            result = yield from engine.turn(prompt, params, on_text, kv=kv, slot=seat.slot)
        finally:
            self.slots.release(seat.slot, keep=False)
        start.account(result.timings)
        return TurnOutcome(result, evicted)

    def _session_turn(self, engine: Engine, session: Session, render: Render, params: TurnParams,
                      on_text: OnText | None, cancel: threading.Event) -> TurnSteps[TurnOutcome]:
        if cancel.is_set():
            raise TurnCancelled("the turn was cancelled before it started")
        prompt = render(engine)
        engine.check_prompt(prompt)  # a bad prompt must not cost the session its cache
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
                engine.load_kv(blobs, seat.slot)
                if blobs is None:
                    start = yield from self._start_from_prefix(engine, session.owner, session.kv, prompt, seat.slot)
                    evicted += start.evicted
            result = yield from engine.turn(prompt, params, on_text, kv=session.kv, slot=seat.slot)
        except BaseException:
            # never leave bookkeeping that disagrees with the caches: the next turn rebuilds
            session.kv.reset()
            engine.load_kv(None, seat.slot)
            raise
        finally:
            self.slots.release(seat.slot, keep=session.state is not SessionState.DELETED)
        result.timings.kv_rebuilt = rebuilt
        start.account(result.timings)
        return TurnOutcome(result, evicted)

    def _start_from_prefix(self, engine: Engine, owner: str, kv: SessionKV, prompt: Prompt,
                           slot: int) -> TurnSteps[PrefixStart]:
        """Start ``kv`` (empty, in ``slot``) from a shared prefix: copy the longest one an
        idle resident session of the same owner holds densely when it is longer than the
        system prompt (a conversation's branch, another agent's history); else restore the
        owner's cached system prompt (sessions.prefix_cache), wait while another turn builds
        it, or build it if it is frequent."""
        t0, n = time.perf_counter(), self.prefixes.end(prompt)
        key = self.prefixes.key(owner, prompt.tokens[:n]) if n else ""
        donor = self._donor(owner, prompt.tokens)
        if donor is not None and donor[2] > n or not n or not self.prefixes.wanted(key):
            return PrefixStart(shared=self._adopt(engine, kv, prompt.tokens, slot, donor))
        if self.prefixes.building(key):
            self.prefixes.waits += 1
            yield Wait(lambda: not self.prefixes.building(key))
        if (blobs := self.prefixes.get(key)) is not None:
            engine.restore_prefix(blobs, prompt.tokens[:n], kv, slot)
            self.prefixes.hits += 1
            return PrefixStart(shared=n, seconds=time.perf_counter() - t0)
        self.prefixes.misses += 1
        self.prefixes.begin(key)
        blobs = None
        try:
            blobs = yield from engine.prefill_prefix(prompt.tokens[:n], kv, slot)
        finally:
            evicted = self.prefixes.finish(key, blobs)
        log.info("prefix_cached", tokens=n)
        return PrefixStart(built=n, seconds=time.perf_counter() - t0, evicted=evicted)

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

    def _adopt(self, engine: Engine, kv: SessionKV, tokens: tuple[int, ...], slot: int,
               donor: tuple[int, Session, int] | None) -> int:
        if donor is None:
            return 0
        donor_slot, holder, _ = donor
        shared = engine.adopt_prefix(tokens, kv, slot, holder.kv, donor_slot)
        if shared:
            self.prefixes.adopted += 1
            log.info("session_prefix_shared", session_id=holder.id, tokens=shared, donor_slot=donor_slot)
        return shared
