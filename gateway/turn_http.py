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
from gateway.protocol import ChatRequest, TurnResult
from gateway.turns import Turn
from sessions.manager import Session

log = structlog.get_logger("specgate.http")


async def begin(request: web.Request, req: ChatRequest, session: Session | None = None) -> Turn:
    """Start ``req`` for the caller: in ``session``, or the one it names (None: stateless).
    Raises 404, 409, 429 and 503 here, before any response starts."""
    runner = request.app[keys.RUNNER]
    structlog.contextvars.bind_contextvars(session_id=req.session_id)
    if session is None:
        session = await runner.session_for(request[OWNER], req.session_id)
    log.info("request_start", stream=req.stream, n_messages=len(req.messages), tools=bool(req.tools),
             path=request.path)
    request_id = request.headers.get("X-Request-Id")
    try:
        return runner.start(req, session, request[OWNER], request_id)
    except SessionBusy:
        if session is None or not await request.app[keys.MANAGER].replace_replayed(session, request_id):
            raise
        return runner.start(req, session, request[OWNER], request_id)


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
