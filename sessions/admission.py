"""Fair admission to the model worker: round-robin across sessions, bounded.

Each session (or stateless request) has its own FIFO; the consumer takes one
job from the next session in the ring, so a session with many queued turns
cannot starve the others.  Up to ``max_running`` jobs run at once (one per
model slot; the step loop batches them), and a session has at most one turn
running (the session manager's claim).  A full queue answers
:class:`QueueFull` (429).

Model-thread calls outside the turns (rendering a prompt, counting a request's tokens) wait
in the worker's inbox, between steps.  They are bounded too (:meth:`FairAdmission.side_call`),
by the same number: a flood of large ``count_tokens`` bodies is refused, not queued ahead of
every stream's next step.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from core.errors import QueueFull

Admitted = Callable[[], Awaitable[Any]]  # a job waiting for its turn on the model thread


class FairAdmission:
    def __init__(self, max_pending: int, max_running: int = 1) -> None:
        self.max_pending = max_pending
        self.max_running = max_running
        self._queues: dict[str, deque[tuple[Admitted, asyncio.Future[Any]]]] = {}
        self._ring: deque[str] = deque()
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._running: set[asyncio.Task[None]] = set()
        self.pending = 0
        self.side_calls = 0

    @property
    def running(self) -> int:
        return len(self._running)

    @property
    def depth(self) -> int:
        return self.pending + self.running + self.side_calls

    @contextlib.asynccontextmanager
    async def side_call(self) -> AsyncIterator[None]:
        """Room for one model-thread call outside the turns, or :class:`QueueFull` (429)."""
        if self.side_calls >= self.max_pending:
            raise QueueFull(f"{self.side_calls} requests already wait for the model thread (limit "
                            f"{self.max_pending})", retry_after_s=2)
        self.side_calls += 1
        try:
            yield
        finally:
            self.side_calls -= 1

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="specgate-admission")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._running) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
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

    async def submit(self, key: str, job: Admitted) -> Any:
        self.admit()
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        queue = self._queues.setdefault(key, deque())
        if not queue:
            self._ring.append(key)
        queue.append((job, fut))
        self.pending += 1
        self._wakeup.set()
        return await fut

    def _next(self) -> tuple[Admitted, asyncio.Future[Any]]:
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
            if not self._ring or len(self._running) >= self.max_running:
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            job, fut = self._next()
            if fut.cancelled():  # the client left while queued
                continue
            task = asyncio.create_task(self._run(job, fut))
            self._running.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wakeup.set()

    @staticmethod
    async def _run(job: Admitted, fut: asyncio.Future[Any]) -> None:
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
