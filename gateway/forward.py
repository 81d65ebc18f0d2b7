"""Requests for a session another replica owns: proxied to the owner.

A balancer that hashes ``X-SpecGate-Session`` sends a session's turns to one
replica; after a replica joins or leaves, or for a request that names its
session only in the body, a turn can land elsewhere.  The replica that gets
it proxies the request -- streams included -- to the owner found in the
registry, so the session's KV is used where it lives.  An owner that cannot
be reached, or that closes the connection before its answer starts, is taken
over: its lease moves here and the session is rebuilt from its stored
history.  That replay is safe because a turn request carries the whole
conversation, and the session's record is replaced by it plus the new reply.

An owner that dies after its answer started cannot be replayed behind the
client's back: a non-streamed answer is read whole before anything is sent,
so the client gets a clean 503 ``owner_lost`` (with ``Retry-After``; the
balancer retries it too); a stream that already sent events ends with an
in-band error event and ``[DONE]``, never a truncated body.  A proxied
request is never proxied again (a moving lease answers 409 instead), and a
WebSocket is not proxied: its upgrade gets 409 ``session_owned_elsewhere``
naming the owner.
"""

from __future__ import annotations

import aiohttp
import orjson
import structlog
from aiohttp import web

from core.errors import OwnedElsewhere, OwnerLost
from gateway import keys
from gateway.error_responses import Handler, error_body

log = structlog.get_logger("specgate.forward")
FORWARDED = "X-SpecGate-Forwarded"
REPLICA = "X-SpecGate-Replica"
HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host",
                 "upgrade", "te", "trailer", "proxy-authorization", "proxy-authenticate"})


class _NotStarted(Exception):
    """The owner failed before any byte of its answer reached our client: replay here."""


@web.middleware
async def route_to_owner(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except OwnedElsewhere as exc:
        if request.headers.get(FORWARDED) or request.headers.get("Upgrade", "").lower() == "websocket":
            raise
        registry = request.app[keys.MANAGER].registry
        url = await registry.address(exc.replica_id)
        if url is not None:
            try:
                return await forward(request, url)
            except _NotStarted as err:
                log.warning("owner_unreachable", owner=exc.replica_id, error=str(err.__cause__ or err))
        if not await registry.take_over(exc.key, exc.replica_id):
            raise
        log.info("session_taken_over", session_key=exc.key, from_replica=exc.replica_id)
        return await handler(request)


async def forward(request: web.Request, base: str) -> web.StreamResponse:
    """Replay ``request`` on ``base`` and relay the answer: a stream as it comes, anything
    else once it is whole.  :class:`_NotStarted` when the owner gave no answer at all."""
    client = request.app[keys.HTTP_CLIENT]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    headers[FORWARDED] = request.app[keys.REPLICA_ID]
    body = await request.read()
    try:
        upstream = await client.request(request.method, base + request.rel_url.path_qs, headers=headers, data=body)
    except aiohttp.ClientError as exc:  # refused, reset, or closed before the status line
        raise _NotStarted(str(exc)) from exc
    async with upstream:
        kept = {k: v for k, v in upstream.headers.items() if k.lower() not in HOP}
        if upstream.content_type != "text/event-stream":
            return await _relay_whole(upstream, kept)
        return await _relay_stream(request, upstream, kept)


async def _relay_whole(upstream: aiohttp.ClientResponse, headers: dict[str, str]) -> web.Response:
    try:
        payload = await upstream.read()
    except aiohttp.ClientError as exc:
        log.warning("owner_lost", status=upstream.status, error=str(exc))
        raise OwnerLost("the replica serving this session stopped before its answer was complete; "
                        "retry the request (the session continues on a live replica)") from exc
    log.info("forwarded", to=str(upstream.url.origin()), status=upstream.status)
    return web.Response(status=upstream.status, body=payload, headers=headers)


async def _relay_stream(request: web.Request, upstream: aiohttp.ClientResponse,
                        headers: dict[str, str]) -> web.StreamResponse:
    resp = web.StreamResponse(status=upstream.status, headers=headers)
    await resp.prepare(request)
    tail = b"\n\n"  # the last bytes relayed: an event boundary or not
    try:
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
            tail = (tail + chunk)[-2:]
    except aiohttp.ClientError as exc:
        log.warning("owner_lost", streaming=True, error=str(exc))
        _, err = error_body(OwnerLost("the replica serving this session stopped mid-stream; retry the "
                                      "request (the session continues on a live replica)"))
        boundary = b"" if tail == b"\n\n" else b"\n\n"
        await resp.write(boundary + b"data: " + orjson.dumps(err) + b"\n\ndata: [DONE]\n\n")
    await resp.write_eof()
    log.info("forwarded", to=str(upstream.url.origin()), status=upstream.status, streaming=True)
    return resp


async def tag_replica(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names the replica that produced it (a proxied one keeps its owner's)."""
    response.headers.setdefault(REPLICA, request.app[keys.REPLICA_ID])
