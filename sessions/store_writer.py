"""Metadata writes off the reply path: buffered, coalesced, retried.

A turn hands its session's record to the writer and returns; one background
task writes the latest record of each session (a delete is a write too, so
one that arrives during an outage is replayed, and a save queued before it
cannot bring the session back).  After a failure the writer backs off --
a circuit breaker that stops a hung or dead Redis from being hammered -- and
retries until the store converges on the latest state.  Any other error (a record the
store cannot encode, a bug) drops that one record, logged, and the writer goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import structlog

from core.errors import StoreUnavailable
from sessions.metadata import MetadataStore

log = structlog.get_logger("specgate.store")
BACKOFF_S = (0.25, 0.5, 1.0, 2.0, 5.0)


class StoreWriter:
    def __init__(self, store: MetadataStore) -> None:
        self.store = store
        self._pending: dict[str, dict[str, Any] | None] = {}  # key -> record, None = delete
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._written = asyncio.Condition()  # notified after every write that lands
        self._task: asyncio.Task[None] | None = None
        self._failures = 0
        self.failed_writes = 0
        self.rejected_writes = 0
        self.dropped_writes = 0  # records dropped for an error that is not an outage
        self.last_error: str | None = None
        self.open_until = 0.0  # circuit open: no attempts before this monotonic time

    @property
    def pending(self) -> int:
        return len(self._pending)

    @property
    def degraded(self) -> bool:
        return self._failures > 0

    def save(self, key: str, record: dict[str, Any]) -> None:
        self._put(key, record)

    def delete(self, key: str) -> None:
        self._put(key, None)

    def _put(self, key: str, record: dict[str, Any] | None) -> None:
        self._pending.pop(key, None)  # re-insert: the newest write goes last
        self._pending[key] = record
        self._idle.clear()
        self._wakeup.set()

    async def load(self, key: str) -> dict[str, Any] | None:
        """A session's latest record: one still waiting to be written (None for a delete)
        wins over the store's, so a session deleted or saved a moment ago reads as such."""
        if key in self._pending:
            return self._pending[key]
        return await self.store.load(key)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="specgate-store-writer")

    async def flush(self, timeout_s: float) -> bool:
        """Wait until every pending write has landed; False if the store did not converge in time."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def landed(self, key: str, timeout_s: float) -> bool:
        """Wait until ``key``'s latest record is in the store (a write another replica must be
        able to read at once); False after ``timeout_s``, when the store is slow or down."""
        async with self._written:
            try:
                await asyncio.wait_for(self._written.wait_for(lambda: key not in self._pending), timeout_s)
            except TimeoutError:
                return False
        return True

    async def stop(self, flush_timeout_s: float = 2.0) -> None:
        if not await self.flush(flush_timeout_s):
            log.warning("store_unflushed", pending=self.pending, error=self.last_error)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        while True:
            if not self._pending:
                self._idle.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if (wait := self.open_until - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            key, record = next(iter(self._pending.items()))
            try:
                if record is None:
                    await self.store.delete(key)
                elif not await self.store.save(key, record):
                    self.rejected_writes += 1
                    log.warning("store_write_rejected", session_key=key, version=record.get("version"),
                                reason="another replica owns the session, or holds a newer version")
            except StoreUnavailable as exc:
                self._trip(str(exc))
                continue
            except Exception as exc:  # not an outage: retrying would fail the same way, so drop it and go on
                self.dropped_writes += 1
                self.last_error = f"{type(exc).__name__}: {exc}"
                log.error("store_write_dropped", session_key=key, error=self.last_error)
            if self._pending.get(key, ...) is record:  # not replaced while it was being written
                del self._pending[key]
                async with self._written:
                    self._written.notify_all()
            if self._failures:
                log.info("store_recovered", after_failures=self._failures)
            self._failures, self.open_until = 0, 0.0

    def _trip(self, error: str) -> None:
        self.failed_writes += 1
        self.last_error = error
        delay = BACKOFF_S[min(self._failures, len(BACKOFF_S) - 1)]
        self._failures += 1
        self.open_until = time.monotonic() + delay
        if self._failures == 1:
            log.warning("store_write_failed", error=error, pending=self.pending)
