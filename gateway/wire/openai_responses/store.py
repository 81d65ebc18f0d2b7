"""Stored responses.  A stored response (``store``, the default) lives in a session the
server makes for it: the response id names that session, so ``previous_response_id``
continues the conversation *and its KV* -- the follow-up sends only its new items and
prefills only them -- on any replica (the record is in Redis, under the caller's key,
with the session's TTL; another key's id is simply not found).  A session keeps its last
:data:`KEPT_RESPONSES` responses; server-made sessions are the first to go when a key
reaches its session cap.

What a key can make the server hold is bounded: a stored body names only the function tools
its output called (hosted tools and unused definitions are dropped: they can be most of an
agent's request), and a conversation's stored bodies share ``Limits.max_stored_response_bytes``,
newest first.  A response whose body no longer fits is still continued by
``previous_response_id`` (that needs only its place in the history); ``GET`` says it is gone."""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson
import structlog
from aiohttp import web

from core.errors import SessionNotFound
from gateway import keys
from gateway.auth import OWNER
from sessions.manager import IMPLICIT_PREFIX, Session

log = structlog.get_logger("specgate.http")
STORE_WAIT_S = 2.0
KEPT_RESPONSES = 16  # per conversation: what GET /v1/responses/{id} and previous_response_id can reach
_ID = re.compile(r"resp_([0-9a-f]{20})_[0-9a-f]{8}")


def new_id(session: Session | None) -> str:
    """``resp_<conversation>_<n>``: the id names the session that holds it (none: not stored)."""
    base = uuid.uuid4().hex[:20]
    if session is not None and session.id.startswith(IMPLICIT_PREFIX):
        base = session.id.removeprefix(IMPLICIT_PREFIX)
    return f"resp_{base}_{uuid.uuid4().hex[:8]}"


def session_id_of(resp_id: str) -> str:
    if not isinstance(resp_id, str) or not (m := _ID.fullmatch(resp_id)):
        raise SessionNotFound(f"response {resp_id!r} not found")
    return f"{IMPLICIT_PREFIX}{m.group(1)}"


async def stored(request: web.Request, resp_id: str) -> tuple[Session, dict[str, Any]]:
    """The caller's session holding ``resp_id`` and its entry; 404 when there is none (another
    key's, deleted, expired or evicted responses alike)."""
    try:
        session = await request.app[keys.MANAGER].get(request[OWNER], session_id_of(resp_id))
    except SessionNotFound:
        raise SessionNotFound(f"response {resp_id!r} not found") from None
    for entry in session.responses:
        if entry["id"] == resp_id:
            return session, entry
    raise SessionNotFound(f"response {resp_id!r} not found")


def body_of(entry: dict[str, Any]) -> dict[str, Any]:
    """The stored body of ``entry``, or 404 when the byte cap dropped it."""
    if entry.get("body") is None:
        raise SessionNotFound(f"response {entry['id']!r} is no longer stored in full (the conversation's "
                              "stored responses passed their byte cap); it can still be continued")
    return entry["body"]


def stored_body(response: dict[str, Any]) -> dict[str, Any]:
    """``response`` as kept: its ``tools`` only the function tools its output called."""
    called = {item.get("name") for item in response.get("output") or () if item.get("type") == "function_call"}
    tools = [t for t in response.get("tools") or () if t.get("type") == "function" and t.get("name") in called]
    return {**response, "tools": tools}


def within(entries: list[dict[str, Any]], cap: int) -> list[dict[str, Any]]:
    """``entries`` with the bodies that do not fit in ``cap`` bytes, newest first, dropped."""
    out, used = [], 0
    for entry in reversed(entries):
        size = len(orjson.dumps(entry["body"])) if entry.get("body") is not None else 0
        fits = used + size <= cap
        used += size if fits else 0
        out.append(entry if fits else {**entry, "body": None})
    return out[::-1]


async def continued(request: web.Request, body: Any) -> tuple[Session | None, list[dict[str, Any]]]:
    """The session ``previous_response_id`` continues and the history up to that response
    (its instructions left out: a request's own instructions apply), or (None, [])."""
    if not isinstance(body, dict) or body.get("previous_response_id") is None:
        return None, []
    session, entry = await stored(request, body["previous_response_id"])
    history = session.messages[: entry["n"]]
    return session, history[1:] if entry["instructions"] and history else history


async def keep(request: web.Request, session: Session | None, response: dict[str, Any], held: int) -> None:
    """Keep ``response`` in its conversation, in the store before the client hears of it (so
    any replica can continue it at once; a store that is down delays this by at most
    :data:`STORE_WAIT_S`).  A reply to an older response branches the history, so the
    responses after that one, which it no longer holds, are dropped.  A request that named no
    response but resent the history (``held``: the messages the conversation held before the
    turn, all of which it continued: that is how it was matched) keeps every earlier one."""
    if session is None:
        return
    prev = response.get("previous_response_id")
    upto = next((r["n"] for r in session.responses if r["id"] == prev), 0) if prev else held
    kept = [r for r in session.responses if r["n"] <= upto]
    if response["store"] and response["status"] != "failed":
        entry = {"id": response["id"], "n": len(session.messages),
                 "instructions": bool(response.get("instructions")), "body": stored_body(response)}
        kept = [*kept, entry][-KEPT_RESPONSES:]
    manager = request.app[keys.MANAGER]
    session.responses = within(kept, request.app[keys.CONFIG].gateway.limits.max_stored_response_bytes)
    manager.mirror(session)
    if not await manager.stored(session, STORE_WAIT_S):
        log.warning("response_not_yet_stored", response_id=response["id"])
