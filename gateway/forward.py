"""Requests for a session another replica owns: proxied to the owner.

A balancer that hashes ``X-Session-Id`` sends a session's turns to one
replica; after a replica joins or leaves, or for a request that names its
session only in the body, a turn can land elsewhere.  The replica that gets
it proxies the request -- streams included -- to the owner found in the
registry, so the session's KV is used where it lives.  An owner that cannot
be reached is taken over: its lease moves here and the session is rebuilt
from its stored history.  A proxied request is never proxied again (a
moving lease answers 409 instead), and a WebSocket is not proxied: its
upgrade gets 409 ``session_owned_elsewhere`` naming the owner.
"""

from __future__ import annotations

import aiohttp
import structlog
from aiohttp import web

from core.errors import OwnedElsewhere
from gateway import keys
from gateway.errors import Handler

log = structlog.get_logger("specgate.forward")
FORWARDED = "X-SpecGate-Forwarded"
REPLICA = "X-SpecGate-Replica"
HOP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length", "content-encoding", "host",
                 "upgrade", "te", "trailer", "proxy-authorization", "proxy-authenticate"})


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
            except aiohttp.ClientConnectionError as err:
                log.warning("owner_unreachable", owner=exc.replica_id, error=str(err))
        if not await registry.take_over(exc.key, exc.replica_id):
            raise
        log.info("session_taken_over", session_key=exc.key, from_replica=exc.replica_id)
        return await handler(request)


async def forward(request: web.Request, base: str) -> web.StreamResponse:
    """Replay ``request`` on ``base`` and stream the answer back as it comes."""
    client = request.app[keys.HTTP_CLIENT]
    headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
    headers[FORWARDED] = request.app[keys.REPLICA_ID]
    async with client.request(request.method, base + request.rel_url.path_qs, headers=headers,
                              data=await request.read()) as upstream:
        resp = web.StreamResponse(status=upstream.status, headers={
            k: v for k, v in upstream.headers.items() if k.lower() not in HOP})
        await resp.prepare(request)
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
        await resp.write_eof()
    log.info("forwarded", to=base, status=upstream.status)
    return resp


async def tag_replica(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names the replica that produced it (a proxied one keeps its owner's)."""
    response.headers.setdefault(REPLICA, request.app[keys.REPLICA_ID])
