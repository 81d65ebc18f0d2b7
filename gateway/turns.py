"""One turn, as HTTP and WebSocket both run it: resolve the session, queue the
job, stream text out of the model thread, record metrics and the reply."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import structlog

from core.decode import StopMatcher
from core.engine import Engine
from core.prompt import Prompt
from gateway import protocol, tool_calls
from gateway.metrics import Metrics
from gateway.protocol import ChatRequest
from sessions.manager import Session, SessionManager, TurnOutcome

log = structlog.get_logger("specgate.turn")


@dataclass(slots=True)
class Turn:
    """A running turn: iterate it for text pieces, then read ``outcome``."""

    request: ChatRequest
    session: Session | None
    cancel: threading.Event = field(default_factory=threading.Event)
    queue: asyncio.Queue[str | None] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[TurnOutcome] | None = None

    async def pieces(self) -> AsyncIterator[str]:
        """Text as generated.  With tools, text that may be a call is held back: from
        ``<tool_call>`` on, and a reply that opens like bare JSON until it is parsed."""
        if not self.request.tools:
            while (piece := await self.queue.get()) is not None:
                yield piece
            return
        cut = StopMatcher((tool_calls.OPEN,))
        held, json_like = "", None
        while (piece := await self.queue.get()) is not None:
            text = "" if cut.stopped else cut.feed(piece)
            if json_like is None and (held + text).strip():
                json_like = (held + text).lstrip().startswith(("{", "[", "```"))
            if json_like is None or json_like:
                held += text
            elif text:
                yield text
        if held and self.task is not None and not self.task.cancelled() and self.task.exception() is None:
            if "tool_calls" not in protocol.reply_message(self.task.result().result.text, self.request.tools):
                yield held

    async def outcome(self) -> TurnOutcome:
        if self.task is None:
            raise RuntimeError("turn was never started")
        return await self.task


class TurnRunner:
    def __init__(self, manager: SessionManager, metrics: Metrics) -> None:
        self.manager = manager
        self.metrics = metrics

    async def session_for(self, session_id: str | None) -> Session | None:
        return await self.manager.get(session_id) if session_id else None

    def start(self, request: ChatRequest, session: Session | None) -> Turn:
        turn = Turn(request, session)
        loop = asyncio.get_running_loop()

        def on_text(piece: str) -> bool:  # model thread
            if turn.cancel.is_set():
                return False
            loop.call_soon_threadsafe(turn.queue.put_nowait, piece)
            return True

        def render(engine: Engine) -> Prompt:  # model thread: tokenizing is llama.cpp work too
            return engine.chat.render(list(request.messages), request.tools)

        key = f"stateless-{uuid.uuid4().hex[:8]}"
        turn.task = asyncio.create_task(self._run(turn, render, on_text, key))
        turn.task.add_done_callback(lambda _: turn.queue.put_nowait(None))
        return turn

    async def _run(self, turn: Turn, render: Any, on_text: Any, key: str) -> TurnOutcome:
        t0 = time.perf_counter()
        outcome = await self.manager.run_turn(turn.session, render, turn.request.policy, turn.request.sampling,
                                              on_text, key)
        t = outcome.result.timings
        self.metrics.turn(t.status, t.ttft_ms, t.n_kept, t.n_prompt - t.cache_n, t.spec_prefill_n,
                          t.n_kept < t.n_prompt - t.cache_n, outcome.rebuilt)
        self.metrics.decoding(t.decode_mode, t.spec)
        if turn.session is not None:
            if not turn.session.store_synced:
                self.metrics.store_errors += 1
            reply = outcome_message(outcome, turn.request.tools)
            turn.session.messages = [*turn.request.messages, reply]
        log.info("turn_done", status=t.status, reason=t.reason, n_prompt=t.n_prompt, cache_n=t.cache_n,
                 spec_prefill_n=t.spec_prefill_n, spec_cache_n=t.spec_cache_n, kept_n=t.n_kept,
                 spec_prefill_ms=round(t.spec_prefill_ms, 1), lookahead_ms=round(t.lookahead_ms, 1),
                 scoring_ms=round(t.scoring_ms, 1), prefill_ms=round(t.prefill_ms, 1),
                 ttft_ms=round(t.ttft_ms, 1), predicted_n=t.n_predicted, decode_ms=round(t.decode_ms, 1),
                 finish=outcome.result.finish_reason, rebuilt=outcome.rebuilt, evicted=outcome.evicted,
                 wall_ms=round((time.perf_counter() - t0) * 1e3, 1))
        return outcome


def outcome_message(outcome: TurnOutcome, tools: tuple[dict[str, Any], ...] | None) -> dict[str, Any]:
    message = protocol.reply_message(outcome.result.text, tools)
    message["content"] = message["content"] or ""
    return message
