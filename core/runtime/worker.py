"""The model worker: the one thread that touches the engine (and so llama.cpp).

The event loop hands it work through a queue of plain messages (core.runtime.messages),
as llama.cpp's server hands tasks to its slots: a :class:`RunTurn` is seated
(core.runtime.seating) and joins the step loop (core.runtime.step_loop), batched with
the other turns; a call (render a prompt, drop a session's KV, settle the tier) runs whole
between two steps.  The worker calls its own parts for each message: no callable from the
event loop's side runs here (``inspect``, for tests and benches, is the one exception).
HTTP code never holds a context.

With no turn in the loop and nothing queued, the thread spends its time on idle work
(core.runtime.idle_work: prefix entries, held replies, scorer catch-up, checkpoints), one
bounded chunk at a time, looking at its queue between chunks: a turn that arrives waits for
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
from core.runtime import idle_work, seating
from core.runtime.messages import Call, Describe, Forget, Post, Render, RunTurn, Settle, Wake
from core.runtime.residency import Residency
from core.runtime.seating import TurnOutcome
from core.runtime.step_loop import Job, StepLoop, StepStats
from core.steps import TurnSteps

if TYPE_CHECKING:  # the engine (llama.cpp) loads on the model thread, not when the gateway is imported
    from core.engine import Engine

log = structlog.get_logger("specgate.worker")
CLOSE_JOIN_S = 30.0  # for the model thread to finish its step and stop
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
        self.residency: Residency | None = None  # the sessions' KV (attach): none, no seating or idle work
        self.catch_up_tokens = 0  # one idle prefill at most (0: none)
        self.idle_enabled = True  # False: idle work stops (a drain settles what it owed)

    def attach(self, residency: Residency, catch_up_tokens: int) -> None:
        """The sessions' KV this thread seats turns in and does idle work on."""
        self.residency, self.catch_up_tokens = residency, catch_up_tokens

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

    async def call(self, msg: Call) -> Any:
        """Do ``msg`` on the model thread between two steps, in a copy of the caller's
        context (so its log lines keep the request and session ids)."""
        self._check()
        return await asyncio.wrap_future(self._queue(_plain(msg, Render, Settle, Describe)))

    async def inspect(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` on the model thread between two steps: tests and benches read
        cells with it; the session layer and the gateway never pass a callable down."""
        self._check()
        return await asyncio.wrap_future(self._queue(fn))

    def post(self, msg: Post) -> None:
        """Queue ``msg`` without waiting for it: queued work runs in order, so whatever is
        queued later (a turn) sees its effect.  A failure is logged, never raised to anyone."""
        self._queue(_plain(msg, Forget, Wake)).add_done_callback(_log_failure)

    def wake(self) -> None:
        """Let idle work look again: it may have found nothing as a turn ended, its session
        not yet marked idle on the event loop, and then waits for the next call."""
        if self.residency is not None and self.idle_enabled:
            self.post(Wake())

    async def turn(self, msg: RunTurn) -> TurnOutcome:
        """Run the turn in the step loop; its request's ``cancel`` is polled before each of
        its prefill chunks."""
        self._check()
        _plain(msg, RunTurn)
        return await asyncio.wrap_future(self._queue(msg, msg.request.cancel.is_set, is_turn=True))  # type: ignore[no-any-return]

    def _queue(self, msg: object, abort: Callable[[], bool] | None = None,
               is_turn: bool = False) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._inbox.put((fut, contextvars.copy_context(), msg, abort, is_turn, self._loop.stats.idle_chunks))
        return fut

    def _check(self) -> None:
        if self._engine is None:
            raise EngineError(f"the models are {self.state.value}: {self.error or 'not started'}")

    async def close(self) -> None:
        thread, engine, self._engine = self._thread, self._engine, None
        if thread is not None:
            self._inbox.put(_STOP)
            await asyncio.get_running_loop().run_in_executor(None, thread.join, CLOSE_JOIN_S)
            if thread.is_alive():  # a stuck llama.cpp call: the thread is a daemon, the exit goes on
                log.error("model_thread_stuck", waited_s=CLOSE_JOIN_S)
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
        if self.residency is None or not self.idle_enabled:
            return False
        try:
            did = idle_work.run_one(self.residency, engine, self.catch_up_tokens)
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
            fut, ctx, msg, abort, is_turn, chunks_then = item
            stats = self._loop.stats
            stats.max_idle_chunks_ahead = max(stats.max_idle_chunks_ahead, stats.idle_chunks - chunks_then)
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                value = ctx.run(self._do, engine, msg)
            except BaseException as exc:  # noqa: BLE001 -- delivered to the caller
                fut.set_exception(exc)
                continue
            if is_turn:
                self._loop.add(Job(_in_context(ctx, value), fut, abort, context=ctx))
            else:
                fut.set_result(value)
        return True


    def _do(self, engine: Engine, msg: object) -> Any:
        """One message's work (a turn's: its steps, for the loop)."""
        res = self.residency
        match msg:
            case RunTurn(request, session):
                if session is None:
                    return seating.stateless(self._seats(res), engine, request)
                return seating.session_turn(self._seats(res), engine, session, request)
            case Render(request, check):
                prompt = request.render(engine)
                if check:
                    engine.check_turn(prompt, request.params)
                return prompt
            case Forget(session):
                return self._seats(res).forget(engine, session)
            case Settle(deadline):
                return idle_work.settle(res, engine, deadline) if res is not None else (0, 0)
            case Describe.STATE_LAYOUT:
                return engine.state_layout()
            case Describe.LAYER_MAP:
                return engine.layer_map
            case Wake():
                return None
            case _ if callable(msg):  # inspect
                return msg(engine)
        raise EngineError(f"the model thread got a message it does not know: {msg!r}")

    @staticmethod
    def _seats(res: Residency | None) -> Residency:
        if res is None:
            raise EngineError("no sessions' KV is attached to the model thread")
        return res


def _plain(msg: object, *kinds: type) -> object:
    """``msg`` if it is one of ``kinds`` (plain data), else TypeError: a callable never
    travels down this way (``inspect`` is the tests' door)."""
    if not isinstance(msg, kinds):
        raise TypeError(f"the model thread takes {', '.join(k.__name__ for k in kinds)} here, "
                        f"not {type(msg).__name__}")
    return msg


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
