"""Stored responses.  A stored response (``store``, the default) lives in a session the
server makes for it: the response id names that session, so ``previous_response_id``
continues the conversation *and its KV* -- the follow-up sends only its new items and
prefills only them -- on any replica (the record is in Redis, under the caller's key,
with the session's TTL; another key's id is simply not found).  A session keeps its last
:data:`KEPT_RESPONSES` responses; server-made sessions are the first to go when a key
reaches its session cap."""

from __future__ import annotations

import re
import uuid
from typing import Any

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


# -- conversations ---------------------------------------------------------------------
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


async def continued(request: web.Request, body: Any) -> tuple[Session | None, list[dict[str, Any]]]:
    """The session ``previous_response_id`` continues and the history up to that response
    (its instructions left out: a request's own instructions apply), or (None, [])."""
    if not isinstance(body, dict) or body.get("previous_response_id") is None:
        return None, []
    session, entry = await stored(request, body["previous_response_id"])
    history = session.messages[: entry["n"]]
    return session, history[1:] if entry["instructions"] and history else history


async def keep(request: web.Request, session: Session | None, response: dict[str, Any]) -> None:
    """Keep ``response`` in its conversation, in the store before the client hears of it (so
    any replica can continue it at once; a store that is down delays this by at most
    :data:`STORE_WAIT_S`).  A reply to an older response branches the history, so the
    responses after that one, which it no longer holds, are dropped."""
    if session is None:
        return
    prev = response.get("previous_response_id")
    upto = next((r["n"] for r in session.responses if r["id"] == prev), 0)
    kept = [r for r in session.responses if r["n"] <= upto]
    if response["store"] and response["status"] != "failed":
        entry = {"id": response["id"], "n": len(session.messages),
                 "instructions": bool(response.get("instructions")), "body": response}
        kept = [*kept, entry][-KEPT_RESPONSES:]
    session.responses = kept
    manager = request.app[keys.MANAGER]
    manager.mirror(session)
    if not await manager.stored(session, STORE_WAIT_S):
        log.warning("response_not_yet_stored", response_id=response["id"])
