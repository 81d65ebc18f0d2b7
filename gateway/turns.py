"""One turn, as HTTP and WebSocket both run it: resolve the session, claim it, queue
the job, stream text out of the model thread, then build the turn's one
:class:`~gateway.chat_request.TurnResult` and record metrics and history from it."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from core.errors import ShuttingDown
from core.prompt import Prompt
from core.turn_request import TurnRequest
from gateway import chat_request, tool_calls
from gateway.chat_request import ChatRequest, TurnResult
from gateway.metrics import Metrics
from sessions.manager import Session, SessionManager

log = structlog.get_logger("specgate.turn")


@dataclass(slots=True, eq=False)  # identity: running turns are kept in a set
class Turn:
    """A running turn: iterate it for text pieces, then await ``result``."""

    request: ChatRequest
    session: Session | None
    owner: str  # the API key's owner id: whose shared prefixes the turn may start from
    cancel: threading.Event = field(default_factory=threading.Event)
    queue: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[TurnResult] | None = None
    call_prefix: str = field(default_factory=lambda: uuid.uuid4().hex[:12])  # its tool calls' ids

    async def pieces(self) -> AsyncIterator[tool_calls.Piece]:
        """Text as generated, and tool calls as they are written.  With tools, text that may be
        a call is held back until the reply is parsed (see :class:`tool_calls.StreamFilter`)."""
        held = tool_calls.StreamFilter(tool_calls.names_of(self.request.tools), self.call_prefix) \
            if self.request.tools else None
        while (piece := await self.queue.get()) is not None:
            for item in held.feed(piece) if held is not None else (piece,):
                yield item
        task = self.task
        if held is not None and task is not None and not task.cancelled() and task.exception() is None:
            if tail := held.release(task.result().message):
                yield tail

    def abandon(self) -> None:
        """The client is done with this turn (finished or gone): stop it, and retrieve its
        outcome so a failure after the client left is not reported as unhandled."""
        self.cancel.set()
        if self.task is not None:
            self.task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def result(self) -> TurnResult:
        if self.task is None:
            raise RuntimeError("turn was never started")
        return await self.task


class TurnRunner:
    def __init__(self, manager: SessionManager, metrics: Metrics, auto_create: bool, implicit: bool = True) -> None:
        self.manager = manager
        self.metrics = metrics
        self.auto_create = auto_create
        self.implicit = implicit  # requests that name no session continue the conversation their tokens match
        self.draining = False
        self.turns: set[Turn] = set()

    async def session_for(self, owner: str, session_id: str | None) -> Session | None:
        """The caller's named session (created on first use when so configured); None: stateless."""
        if not session_id:
            return None
        if self.auto_create:
            return await self.manager.get_or_create(owner, session_id)
        return await self.manager.get(owner, session_id)

    async def conversation_for(self, owner: str, request: ChatRequest,
                               required: bool = False) -> tuple[Session | None, Prompt | None]:
        """For a request that names no session: the implicit session its rendered tokens
        continue, else a new one (None: stateless, when the owner has no room), and the
        rendered prompt.  ``required``: a session even when matching is off, or 429 (a
        response to store).  Return to :meth:`start` without awaiting: a found session is
        idle now, and the claim must see it so."""
        if not self.implicit:
            return (await self.manager.start_implicit(owner, True) if required else None), None
        prompt = await self.manager.render(to_turn(request, owner))
        session = self.manager.continuing(owner, prompt.tokens, request.hint)
        if session is None:
            session = await self.manager.start_implicit(owner, required, request.hint)
        return session, prompt

    def start(self, request: ChatRequest, session: Session | None, owner: str, request_id: str | None = None,
              prompt: Prompt | None = None) -> Turn:
        """Claim the session and queue the turn; raises (409, 503, 429) before anything runs.
        ``prompt``: the request already rendered and checked (``SessionManager.render``, see
        :meth:`conversation_for`): the model thread does not check it again."""
        if self.draining:
            raise ShuttingDown("the server is shutting down; retry on another replica")
        self.manager.admit()
        turn = Turn(request, session, owner)
        if session is not None:
            self.manager.claim(session, turn.cancel, request_id)
        loop = asyncio.get_running_loop()

        def on_text(piece: str) -> bool:  # model thread
            if turn.cancel.is_set():
                return False
            loop.call_soon_threadsafe(turn.queue.put_nowait, piece)
            return True

        work = to_turn(request, owner, cancel=turn.cancel, sink=on_text, prompt=prompt, checked=prompt is not None)
        turn.task = asyncio.create_task(self._run(turn, work))
        self.turns.add(turn)
        turn.task.add_done_callback(lambda _: self._finished(turn))
        return turn

    def _finished(self, turn: Turn) -> None:
        turn.queue.put_nowait(None)
        self.turns.discard(turn)

    async def _run(self, turn: Turn, work: TurnRequest) -> TurnResult:
        t0 = time.perf_counter()
        try:
            outcome = await self.manager.run_turn(turn.session, work)
        except asyncio.CancelledError:
            self.metrics.turn_ended("cancelled")
            raise
        except Exception as exc:
            self.metrics.turn_ended("failed")
            log.warning("turn_failed", error=str(exc), error_type=type(exc).__name__)
            raise
        finally:
            if turn.session is not None:
                self.manager.release(turn.session)
        result = chat_request.turn_result(outcome.result, turn.request.tools, turn.call_prefix)
        self._record(turn, result)
        if result.timings.max_tokens_asked:
            log.info("max_tokens_clamped", asked=result.timings.max_tokens_asked, ceiling=result.timings.max_tokens)
        log.info("turn_done", finish=result.finish_reason, evicted=len(outcome.evicted),
                 wall_ms=round((time.perf_counter() - t0) * 1e3, 1), **result.timings.to_json())
        return result

    def _record(self, turn: Turn, result: TurnResult) -> None:
        self.metrics.turn(result.timings)
        self.metrics.turn_ended("cancelled" if result.finish_reason == "cancelled" else "completed")
        if turn.session is not None:
            turn.session.messages = [*turn.request.messages, result.message]
            self.manager.mirror(turn.session)
            if result.message.get("tool_calls") and result.finish_reason != "cancelled":
                self.manager.expect_resend(turn.session, turn.request.tools)

    async def drain(self, timeout_s: float) -> int:
        """Stop taking turns, let running ones finish for ``timeout_s``, then cancel the rest;
        returns how many were cancelled."""
        self.draining = True
        pending = [t.task for t in list(self.turns) if t.task is not None]
        if not pending:
            return 0
        _, late = await asyncio.wait(pending, timeout=timeout_s)
        for turn in list(self.turns):
            turn.cancel.set()
        if late:
            await asyncio.wait(late, timeout=10)
        return len(late)


def to_turn(request: ChatRequest, owner: str, **how: Any) -> TurnRequest:
    """The wire request as the layers below take it (``how``: cancel, sink, prompt, checked)."""
    return TurnRequest(owner, request.messages, request.tools, request.params, **how)
