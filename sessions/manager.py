"""The session manager: session lifecycle, KV residency, and turns.

Both models' contexts hold one session's KV at a time (the resident one).
Switching sessions saves the resident's KV into :class:`ParkedKV` (RAM
under a budget, LRU, optional disk spill) and restores the incoming one; a
session whose KV was dropped rebuilds it from its tokens on its next turn.
Metadata and status are mirrored into the metadata store (Redis) after each
change; if that store is down, turns still run and the mirror catches up on
the next successful write.
"""

from __future__ import annotations

import enum
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog

from core.config import TurnParams
from core.decode import OnText
from core.engine import Engine, Result
from core.errors import InvalidRequest, SessionNotFound, StoreUnavailable
from core.prompt import Prompt
from core.session_kv import SessionKV
from core.worker import ModelWorker
from sessions.metadata import MetadataStore
from sessions.parked_kv import ParkedKV
from sessions.scheduler import FairScheduler

log = structlog.get_logger("specgate.sessions")
SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
Render = Callable[[Engine], Prompt]  # runs on the model thread


class SessionState(enum.StrEnum):
    IDLE = "idle"
    RUNNING = "running"


class KVLocation(enum.StrEnum):
    NONE = "none"  # nothing cached yet
    RESIDENT = "resident"  # live in the model contexts
    RAM = "ram"
    DISK = "disk"
    EVICTED = "evicted"  # dropped: the next turn rebuilds it


def check_id(session_id: str) -> str:
    """Client-chosen ids are ASCII letters, digits, '-' and '_' (they name files and keys)."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise InvalidRequest("a session id must be 1-128 ASCII letters, digits, '-' or '_'")
    return session_id


@dataclass(slots=True)
class Session:
    id: str
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
    store_synced: bool = True
    kv: SessionKV = field(default_factory=SessionKV)
    messages: list[dict[str, Any]] = field(default_factory=list)

    def meta(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "session", "created": int(self.created),
            "last_active": int(self.last_active), "state": self.state.value, "turns": self.turns,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "context_tokens": self.context_tokens, "kept_ratio": self.last_kept_ratio,
            "last_status": self.last_status, "last_ttft_ms": self.last_ttft_ms,
            "kv": self.kv_location.value, "rebuilds": self.rebuilds,
            "target_cached_tokens": self.kv.target.n_cached, "speculator_cached_tokens": self.kv.speculator.n_cached,
        }

    @classmethod
    def from_meta(cls, meta: dict[str, Any]) -> Session:
        """A session known only from the store (restart, other replica): its KV rebuilds."""
        s = cls(id=meta["id"], created=meta.get("created", time.time()),
                last_active=meta.get("last_active", time.time()))
        s.turns = int(meta.get("turns", 0))
        s.prompt_tokens = int(meta.get("prompt_tokens", 0))
        s.completion_tokens = int(meta.get("completion_tokens", 0))
        s.last_status, s.last_ttft_ms = meta.get("last_status"), meta.get("last_ttft_ms")
        s.kv_location = KVLocation.EVICTED if s.turns else KVLocation.NONE
        s.rebuilds = int(meta.get("rebuilds", 0))
        return s


@dataclass(slots=True)
class TurnOutcome:
    result: Result
    evicted: list[str]  # sessions whose parked KV was evicted to make room for this turn


class SessionManager:
    def __init__(self, worker: ModelWorker, store: MetadataStore, parked: ParkedKV,
                 scheduler: FairScheduler) -> None:
        self.worker = worker
        self.store = store
        self.parked = parked
        self.scheduler = scheduler
        self._sessions: dict[str, Session] = {}
        self._resident: str | None = None

    @property
    def live(self) -> int:
        return len(self._sessions)

    # -- lifecycle -------------------------------------------------------------
    async def create(self, session_id: str | None = None) -> Session:
        session = Session(id=check_id(session_id) if session_id is not None else f"sess-{uuid.uuid4().hex[:16]}")
        await self.mirror(session, strict=True)  # a session nobody else can see is not created
        created = self._sessions.setdefault(session.id, session)  # a concurrent create of the id wins once
        log.info("session_created", session_id=session.id)
        return created

    async def get_or_create(self, session_id: str) -> Session:
        """The session named ``session_id``, created on first use (clients that speak only
        the OpenAI API cannot call ``POST /v1/sessions`` first)."""
        try:
            return await self.get(session_id)
        except SessionNotFound:
            return await self.create(session_id)

    async def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is not None:
            return session
        meta = await self.store.load(session_id)
        if meta is None:
            raise SessionNotFound(f"unknown session {session_id!r}")
        session = Session.from_meta(meta)
        self._sessions[session_id] = session
        log.info("session_hydrated", session_id=session_id, turns=session.turns)
        return session

    async def exists(self, session_id: str) -> bool:
        return session_id in self._sessions or await self.store.load(session_id) is not None

    async def delete(self, session_id: str) -> None:
        local = self._sessions.pop(session_id, None)
        self.parked.discard(session_id)
        if self._resident == session_id:
            self._resident = None
        try:
            stored = await self.store.delete(session_id)
        except StoreUnavailable:
            if local is None:
                raise
            stored = False
        if local is None and not stored:
            raise SessionNotFound(f"unknown session {session_id!r}")
        log.info("session_deleted", session_id=session_id)

    async def mirror(self, session: Session, strict: bool = False) -> None:
        """Write the session's metadata to the store; a failure is reported, not fatal."""
        try:
            await self.store.save(session.id, session.meta())
            session.store_synced = True
        except StoreUnavailable as exc:
            session.store_synced = False
            log.warning("store_write_failed", session_id=session.id, error=str(exc))
            if strict:
                raise

    def location(self, session: Session) -> str:
        if session.id == self._resident:
            return KVLocation.RESIDENT.value
        where = self.parked.where(session.id)
        if where != "none":
            return where
        return session.kv_location.value

    # -- turns -----------------------------------------------------------------
    async def run_turn(self, session: Session | None, render: Render, params: TurnParams,
                       on_text: OnText | None, key: str) -> TurnOutcome:
        if session is None:
            return await self.scheduler.submit(key, lambda: self.worker.call(
                lambda engine: self._stateless(engine, render, params, on_text)))
        session.state = SessionState.RUNNING
        try:
            outcome: TurnOutcome = await self.scheduler.submit(session.id, lambda: self.worker.call(
                lambda engine: self._session_turn(engine, session, render, params, on_text)))
        finally:
            session.state = SessionState.IDLE
        self._record(session, outcome)
        await self.mirror(session)
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
        session.kv_location = KVLocation.RESIDENT
        for sid in outcome.evicted:
            if (victim := self._sessions.get(sid)) is not None:
                victim.kv_location = KVLocation.DISK if self.parked.spill_dir else KVLocation.EVICTED

    # -- model thread ------------------------------------------------------------
    def _park_resident(self, engine: Engine) -> list[str]:
        """Save the resident session's KV (model thread only)."""
        resident, self._resident = self._resident, None
        if resident is None or resident not in self._sessions:
            return []
        evicted = self.parked.put(resident, engine.save_kv())
        for sid in evicted:
            log.info("session_kv_evicted", session_id=sid, spilled=self.parked.spill_dir is not None)
        return evicted

    def _stateless(self, engine: Engine, render: Render, params: TurnParams,
                   on_text: OnText | None) -> TurnOutcome:
        prompt = render(engine)
        engine.check_prompt(prompt)  # before the resident session's KV is disturbed
        evicted = self._park_resident(engine)
        return TurnOutcome(engine.run(prompt, params, on_text), evicted)

    def _session_turn(self, engine: Engine, session: Session, render: Render, params: TurnParams,
                      on_text: OnText | None) -> TurnOutcome:
        prompt = render(engine)
        engine.check_prompt(prompt)  # a bad prompt must not cost the session its cache
        evicted: list[str] = []
        rebuilt = False
        if self._resident != session.id:
            evicted = self._park_resident(engine)
            blobs = self.parked.take(session.id)
            if blobs is None and session.turns:
                # dropped under the budget (or held by another replica): rebuild from scratch
                session.kv.reset()
                session.rebuilds += 1
                rebuilt = True
                log.info("session_kv_rebuild", session_id=session.id)
            engine.load_kv(blobs)
            self._resident = session.id
        try:
            result = engine.run(prompt, params, on_text, kv=session.kv)
        except Exception:
            # never leave bookkeeping that disagrees with the caches: the next turn rebuilds
            session.kv.reset()
            engine.load_kv(None)
            raise
        result.timings.kv_rebuilt = rebuilt
        return TurnOutcome(result, evicted)
