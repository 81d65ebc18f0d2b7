"""A parsed turn request, run for an HTTP caller: started in its session (every protocol's
handler calls :func:`begin`), and run to its end when not streamed (:func:`complete`;
streams go through :mod:`gateway.sse`)."""

from __future__ import annotations

import asyncio

import structlog
from aiohttp import web

from core.errors import SessionBusy
from gateway import keys
from gateway.auth import OWNER
from gateway.chat_request import ChatRequest, TurnResult
from gateway.client_hints import IMPLICIT_HEADER, SESSION_HEADER
from gateway.turns import Turn, to_turn
from sessions.manager import Session

log = structlog.get_logger("specgate.http")


async def begin(request: web.Request, req: ChatRequest, session: Session | None = None, keep: bool = False) -> Turn:
    """Start ``req`` for the caller: in ``session``, the one it names, or the conversation its
    tokens continue (None: stateless); ``keep``: in a session even then (a response to store).
    Raises 404, 409, 429 and 503 here, before any response starts."""
    runner = request.app[keys.RUNNER]
    structlog.contextvars.bind_contextvars(session_id=req.session_id)
    prompt = None
    if session is None and req.session_id:
        session = await runner.session_for(request[OWNER], req.session_id)
    elif session is None:
        session, prompt = await runner.conversation_for(request[OWNER], req, keep)
    request_id = request.headers.get("X-Request-Id")
    if prompt is None:  # rendered and checked now: a prompt over the context is a 400 before any byte of stream
        if session is not None:  # a busy session's 409 costs the model thread nothing
            request.app[keys.MANAGER].check_free(session, request_id)
        prompt = await request.app[keys.MANAGER].render(to_turn(req, request[OWNER]))
    log.info("request_start", stream=req.stream, n_messages=len(req.messages), tools=bool(req.tools),
             path=request.path, implicit=session is not None and session.implicit, prompt_n=len(prompt))
    try:
        return runner.start(req, session, request[OWNER], request_id, prompt)
    except SessionBusy:
        if session is None or not await request.app[keys.MANAGER].replace_replayed(session, request_id):
            raise
        return runner.start(req, session, request[OWNER], request_id, prompt)


async def complete(request: web.Request, turn: Turn) -> TurnResult:
    """Run a non-streamed turn to its end; a client that leaves stops it."""
    try:
        async for _ in turn.pieces():
            pass
        return await turn.result()
    except asyncio.CancelledError:  # the client left (handler cancellation): stop generating for nobody
        request.app[keys.METRICS].disconnects.labels("http").inc()
        log.info("client_disconnected", stream=False)
        raise
    finally:
        turn.abandon()


def session_headers(turn: Turn) -> dict[str, str] | None:
    """``X-SpecGate-Session``: the session that served the turn, named or found by its tokens
    (``X-SpecGate-Session-Implicit: 1``); a client may name it from then on."""
    if turn.session is None:
        return None
    if turn.session.implicit:
        return {SESSION_HEADER: turn.session.id, IMPLICIT_HEADER: "1"}
    return {SESSION_HEADER: turn.session.id}
