"""One session: its lifecycle, where its KV lives, and the record the store keeps.

Sessions are namespaced by owner (the API key that created them): a session is
found by ``(owner, id)``.  A session is *implicit* when the server made it -- for
a conversation that named no session, found again by its tokens, or for a
stored Responses API answer -- rather than a client naming it; implicit
sessions make room first when a key or the server is at its cap.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from core.kv.positions import SessionKV
from sessions.ids import session_key

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
    hint: str | None = None  # the client's grouping hint (prompt_cache_key, user) an implicit session was made under
    last_prompt_n: int = 0  # tokens of the last turn's prompt: a request that covers them continues the conversation
    responses: list[dict[str, Any]] = field(default_factory=list)  # stored Responses API answers, newest last
    # the last reply called tools (with these tools offered): idle work rewrites the held reply in
    # the form the client resends it (sessions.kv.held_reply)
    resend_tools: tuple[dict[str, Any], ...] | None = None
    dropped: bool = False  # the table let it go (deleted, expired, moved away): its KV is worth nothing

    @property
    def idle(self) -> bool:
        return self.state is SessionState.IDLE

    @property
    def deleted(self) -> bool:
        return self.state is SessionState.DELETED

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
