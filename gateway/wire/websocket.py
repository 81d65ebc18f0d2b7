"""WebSocket sessions: ``GET /v1/sessions/{id}/ws``.

Client -> server: ``{"type": "turn", "messages": [new messages only], ...params}``
and ``{"type": "cancel"}``.  Server -> client: ``{"type": "delta", "content"}``
events, then ``{"type": "done", "message", "finish_reason", "usage", "timings"}``;
errors are ``{"type": "error", "code", "message"}`` and leave the socket open.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import orjson
import structlog
from aiohttp import WSMsgType, web

from core.errors import InvalidRequest, SessionBusy
from gateway import chat_request, keys
from gateway.auth import OWNER
from gateway.bodies import off_loop
from gateway.error_responses import ws_error
from gateway.turns import Turn
from gateway.wire.openai_chat import objects as openai_chat_objects
from sessions.manager import Session

log = structlog.get_logger("specgate.ws")
routes = web.RouteTableDef()


@routes.get("/v1/sessions/{id}/ws")
async def session_ws(request: web.Request) -> web.WebSocketResponse:
    session = await request.app[keys.MANAGER].get(request[OWNER], request.match_info["id"])  # 404 before upgrade
    structlog.contextvars.bind_contextvars(session_id=session.id)
    ws = web.WebSocketResponse(heartbeat=30.0, max_msg_size=request.app[keys.CONFIG].gateway.max_body_mb << 20)
    await ws.prepare(request)
    request.app[keys.WEBSOCKETS].add(ws)
    current: Turn | None = None
    task: asyncio.Task[None] | None = None
    try:
        async for msg in ws:
            if msg.type != WSMsgType.TEXT:
                continue
            try:
                event = orjson.loads(msg.data)
                if not isinstance(event, dict):
                    raise InvalidRequest("each message must be a JSON object")
                kind = event.get("type")
                if kind == "cancel":
                    if current is not None:
                        current.cancel.set()
                elif kind == "turn":
                    if task is not None and not task.done():
                        raise SessionBusy("a turn is already running on this socket; send cancel first")
                    current = await start_turn(request, session, event)
                    task = asyncio.create_task(stream_turn(ws, current))
                else:
                    raise InvalidRequest(f"unknown message type {kind!r}; expected 'turn' or 'cancel'")
            except orjson.JSONDecodeError as exc:
                await ws.send_json(ws_error(InvalidRequest(f"malformed JSON: {exc}")))
            except Exception as exc:
                log.warning("ws_error", error=str(exc), error_type=type(exc).__name__)
                await ws.send_json(ws_error(exc))
    finally:
        request.app[keys.WEBSOCKETS].discard(ws)
        if current is not None:
            current.abandon()
        if task is not None:
            with contextlib.suppress(Exception):
                await task
    return ws


async def start_turn(request: web.Request, session: Session, event: dict[str, Any]) -> Turn:
    new = event.get("messages")
    if not isinstance(new, list) or not new:
        raise InvalidRequest("'messages' must be a non-empty list of the new messages")
    body = {**{k: v for k, v in event.items() if k != "type"}, "messages": [*session.messages, *new],
            "stream": True}
    config = request.app[keys.CONFIG]
    req = await off_loop(chat_request.parse_chat, body, request.app[keys.DEFAULTS], session.id,
                         config.gateway.limits, config.engine.context_limit)
    return request.app[keys.RUNNER].start(req, session, session.owner)


async def stream_turn(ws: web.WebSocketResponse, turn: Turn) -> None:
    try:
        async for piece in turn.pieces():
            if isinstance(piece, str):  # calls arrive whole, in ``done``
                await ws.send_json({"type": "delta", "content": piece})
        result = await turn.result()
    except ConnectionResetError:
        turn.abandon()
        log.info("client_disconnected", transport="ws")
        return
    except Exception as exc:
        log.warning("ws_turn_error", error=str(exc), error_type=type(exc).__name__)
        if not ws.closed:
            await ws.send_json(ws_error(exc))
        return
    if not ws.closed:
        await ws.send_json({"type": "done", "message": result.message, "finish_reason": result.finish_reason,
                            "usage": openai_chat_objects.usage(result.timings), "timings": result.timings.to_json()})
