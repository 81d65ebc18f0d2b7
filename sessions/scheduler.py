"""Fair admission to the model worker: round-robin across sessions, bounded.

Each session (or stateless request) has its own FIFO; the single consumer
takes one job from the next session in the ring, so a session with many
queued turns cannot starve the others.  One job runs at a time, hence one
turn at a time per session.  A full queue answers :class:`QueueFull` (429).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from core.errors import QueueFull

Job = Callable[[], Awaitable[Any]]


class FairScheduler:
    def __init__(self, max_pending: int) -> None:
        self.max_pending = max_pending
        self._queues: dict[str, deque[tuple[Job, asyncio.Future[Any]]]] = {}
        self._ring: deque[str] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.pending = 0
        self.running = False

    @property
    def depth(self) -> int:
        return self.pending + (1 if self.running else 0)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="specgate-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        for queue in self._queues.values():
            for _, fut in queue:
                fut.cancel()
        self._queues.clear()
        self._ring.clear()
        self.pending = 0

    def admit(self) -> None:
        """Raise :class:`QueueFull` now if a job could not be queued (before a stream starts)."""
        if self.pending >= self.max_pending:
            raise QueueFull(f"{self.pending} requests already queued (limit {self.max_pending})",
                            retry_after_s=2)

    async def submit(self, key: str, job: Job) -> Any:
        self.admit()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault(key, deque())
        if not queue:
            self._ring.append(key)
        queue.append((job, fut))
        self.pending += 1
        self._wakeup.set()
        return await fut

    def _next(self) -> tuple[Job, asyncio.Future[Any]]:
        key = self._ring.popleft()
        queue = self._queues[key]
        item = queue.popleft()
        if queue:
            self._ring.append(key)
        else:
            del self._queues[key]
        self.pending -= 1
        return item

    async def _loop(self) -> None:
        while True:
            if not self._ring:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job, fut = self._next()
            if fut.cancelled():  # the client left while queued
                continue
            self.running = True
            try:
                result = await job()
            except asyncio.CancelledError:
                fut.cancel()
                raise
            except Exception as exc:  # delivered to the waiting request
                if not fut.cancelled():
                    fut.set_exception(exc)
            else:
                if not fut.cancelled():
                    fut.set_result(result)
            finally:
                self.running = False
