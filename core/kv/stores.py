"""What the model thread's KV owner needs of the byte stores and of a session.

The stores -- parked sessions' KV, the shared-prefix cache, the session checkpoints in
the KV tier -- keep bytes, not cells, and live in the session layer (``sessions/kv/``);
the residency on the model thread (core.runtime.residency) reaches them only through
these interfaces, so ``core/`` never imports ``sessions/``.  A :class:`Holder` is the
model thread's view of a session: what seating and idle work read and write of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from core.kv.positions import SessionKV
from core.prompt import Prompt

Blobs = tuple[bytes, bytes]  # saved KV: (target, speculator)


@runtime_checkable
class Holder(Protocol):
    """A session as the model thread sees it (sessions.session.Session is one)."""

    id: str
    owner: str
    kv: SessionKV
    turns: int
    rebuilds: int
    messages: list[dict[str, Any]]
    last_prompt_n: int
    resend_tools: tuple[dict[str, Any], ...] | None  # set: idle work rewrites the held reply (taken once)

    @property
    def key(self) -> str: ...

    @property
    def idle(self) -> bool:
        """No turn is running for it."""

    @property
    def deleted(self) -> bool: ...

    @property
    def dropped(self) -> bool:
        """Deleted, expired or moved away: its table no longer holds it, nothing worth keeping."""


class ParkedStore(Protocol):
    def put(self, key: str, blobs: Blobs, spill: bool = True) -> list[str]: ...

    def take(self, key: str) -> Blobs | None: ...

    def discard(self, key: str) -> None: ...

    def where(self, key: str) -> str: ...


class PrefixStore(Protocol):
    hits: int
    misses: int
    waits: int
    adopted: int
    unfilled: dict[str, tuple[str, tuple[int, ...]]]  # wanted entries: key -> (owner, tokens)
    lacking: dict[str, tuple[str, tuple[int, ...]]]  # entries without the scorer's part

    def key(self, owner: str, tokens: Sequence[int]) -> str: ...

    def end(self, prompt: Prompt) -> int: ...

    def wanted(self, key: str) -> bool: ...

    def want(self, key: str, owner: str, tokens: tuple[int, ...]) -> None: ...

    def building(self, key: str) -> bool: ...

    def begin(self, key: str) -> None: ...

    def finish(self, key: str, blobs: Blobs | None) -> list[str]: ...

    def load(self, key: str) -> tuple[Blobs | None, list[str], str]: ...

    def note(self, key: str, owner: str, tokens: tuple[int, ...], blobs: Blobs) -> None: ...

    def forget(self, key: str) -> None: ...

    def fill(self, key: str, owner: str, tokens: tuple[int, ...], blobs: Blobs) -> list[str]: ...

    def complete(self, key: str, blobs: Blobs) -> list[str]: ...


class CheckpointStore(Protocol):
    written: int
    restored: int
    lent: int

    def due(self, session_key: str, n: int) -> bool: ...

    def write(self, session_key: str, owner: str, tokens: Sequence[int], blobs: Blobs) -> bool: ...

    def find(self, session_key: str, owner: str, tokens: Sequence[int],
             min_tokens: int = 32) -> tuple[int, int, Blobs] | None: ...

    def forget(self, session_key: str, owner: str) -> None: ...

    def best_lender(self, owner: str, tokens: Sequence[int], n: int, min_run: int,
                    max_gap: int) -> tuple[tuple[int, ...], str] | None: ...

    def load(self, key: str) -> Blobs | None: ...
