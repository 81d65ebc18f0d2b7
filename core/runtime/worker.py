"""The model worker: the one thread that touches the engine (and so llama.cpp).

The event loop hands it work through a queue, as llama.cpp's server hands
tasks to its slots: a *turn* (a generator, see core.steps) joins the step loop
(core.runtime.step_loop) and is batched with the other turns; a *call* (parking a
session's KV, a delete, a lookup) runs whole between two steps.  HTTP code
never holds a context.

With no turn in the loop and nothing queued, the thread spends its time on
:attr:`ModelWorker.idle` work (the sessions layer catches scorers up), one bounded
chunk at a time, looking at its queue between chunks: a turn that arrives waits for
one chunk at most (``stats.max_idle_chunks_ahead`` counts what one did wait).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextvars
import enum
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import structlog

from core.config import EngineConfig
from core.errors import EngineError
from core.runtime.step_loop import Job, StepLoop, StepStats
from core.steps import TurnSteps

if TYPE_CHECKING:  # the engine (llama.cpp) loads on the model thread, not when the gateway is imported
    from core.engine import Engine

log = structlog.get_logger("specgate.worker")
T = TypeVar("T")
_STOP = object()


class ModelState(enum.StrEnum):
    LOADING = "loading"
    READY = "ready"
    FAILED = "failed"
    CLOSED = "closed"


class ModelWorker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.state = ModelState.LOADING
        self.error: str | None = None
        self._engine: Engine | None = None
        self._loop = StepLoop(config.step_tokens, config.prefill_share, config.progress_log_s)
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        # idle work: one chunk per call, on the model thread; returns False when there is none
        self.idle: Callable[[Engine], bool] | None = None

    @property
    def stats(self) -> StepStats:
        return self._loop.stats

    async def start(self) -> None:
        ready: concurrent.futures.Future[Engine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(ready,), name="specgate-model", daemon=True)
        self._thread.start()
        try:
            self._engine = await asyncio.wrap_future(ready)
        except Exception as exc:
            self.state, self.error = ModelState.FAILED, str(exc)
            raise
        self.state = ModelState.READY

    async def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the model thread between two steps, in a copy of the
        caller's context (so its log lines keep the request and session ids)."""
        self._check()
        return await asyncio.wrap_future(self._queue(fn))

    def post(self, fn: Callable[[Engine], Any]) -> None:
        """Queue ``fn(engine)`` for the model thread without waiting for it: queued work
        runs in order, so whatever is queued later (a turn) sees its effect.  A failure is
        logged, never raised to anyone."""
        self._queue(fn).add_done_callback(_log_failure)

    def wake(self) -> None:
        """Let idle work look again: it may have found nothing as a turn ended, its session
        not yet marked idle on the event loop, and then waits for the next call."""
        if self.idle is not None:
            self.post(lambda engine: None)

    async def turn(self, start: Callable[[Engine], TurnSteps[T]], abort: Callable[[], bool] | None = None) -> T:
        """Run the turn ``start(engine)`` returns in the step loop; ``abort`` is polled
        before each of its prefill chunks."""
        self._check()
        return await asyncio.wrap_future(self._queue(start, abort, is_turn=True))

    def _queue(self, fn: Callable[[Engine], Any], abort: Callable[[], bool] | None = None,
               is_turn: bool = False) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put((fut, contextvars.copy_context(), fn, abort, is_turn, self._loop.stats.idle_chunks))
        return fut

    def _check(self) -> None:
        if self._engine is None:
            raise EngineError(f"the models are {self.state.value}: {self.error or 'not started'}")

    async def close(self) -> None:
        thread, engine, self._engine = self._thread, self._engine, None
        if thread is not None:
            self._inbox.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, thread.join)
        self.state = ModelState.CLOSED
        del engine

    # -- the model thread -------------------------------------------------------
    def _main(self, ready: concurrent.futures.Future[Engine]) -> None:
        from core.engine import Engine

        try:
            engine = Engine(self.config)
        except BaseException as exc:  # noqa: BLE001 -- reported to start()
            ready.set_exception(exc)
            return
        self._loop.budget.cost = engine.prefill_seconds
        ready.set_result(engine)
        try:
            idle_done = False  # the idle work ran out: block on the queue until something arrives
            while self._take(engine, block=not self._loop.busy and idle_done):
                if self._loop.busy:
                    self._loop.step()
                    idle_done = False
                else:
                    idle_done = not self._idle_chunk(engine)
        finally:
            self._loop.cancel_all("the server is shutting down")
            engine.close()

    def _idle_chunk(self, engine: Engine) -> bool:
        """One chunk of idle work; False when there is none (or it failed: logged, not retried
        until the next turn)."""
        if self.idle is None:
            return False
        try:
            did = self.idle(engine)
        except Exception as exc:  # noqa: BLE001 -- idle work must never take the thread down
            log.error("idle_work_failed", error=f"{type(exc).__name__}: {exc}")
            return False
        if did:
            self._loop.stats.idle_chunks += 1
        return did

    def _take(self, engine: Engine, block: bool) -> bool:
        """Run the calls and admit the turns queued when it starts (``block``: wait for one
        first), and no more: callers that queue a new call as soon as one returns (a flood of
        ``count_tokens``) get one per step, never the whole thread.  False on stop."""
        left = max(1, self._inbox.qsize())
        while left:
            left -= 1
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return True
            if block:
                block, left = False, self._inbox.qsize()  # what arrived while it waited
            if item is _STOP:
                return False
            fut, ctx, fn, abort, is_turn, chunks_then = item
            stats = self._loop.stats
            stats.max_idle_chunks_ahead = max(stats.max_idle_chunks_ahead, stats.idle_chunks - chunks_then)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                value = ctx.run(fn, engine)
            except BaseException as exc:  # noqa: BLE001 -- delivered to the caller
                fut.set_exception(exc)
                continue
            if is_turn:
                self._loop.add(Job(_in_context(ctx, value), fut, abort, context=ctx))
            else:
                fut.set_result(value)
        return True


def _log_failure(fut: concurrent.futures.Future[Any]) -> None:
    if not fut.cancelled() and (exc := fut.exception()) is not None:
        log.error("model_job_failed", error=f"{type(exc).__name__}: {exc}")


def _in_context(ctx: contextvars.Context, turn: TurnSteps[T]) -> TurnSteps[T]:
    """``turn``, each resumption run inside ``ctx`` (the request's log context)."""
    resume: Callable[[Any], Any] = turn.send
    value: Any = None
    while True:
        try:
            request = ctx.run(resume, value)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]
        try:
            value, resume = (yield request), turn.send
        except GeneratorExit:
            turn.close()
            raise
        except BaseException as exc:  # noqa: BLE001 -- thrown in by the loop: pass it on
            value, resume = exc, turn.throw
