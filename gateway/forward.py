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
balancer retries it too); a stream that already sent events ends with its
protocol's own error event (:class:`StreamTail`), never a truncated body.  A proxied
request is never proxied again (a moving lease answers 409 instead), and a
WebSocket is not proxied: its upgrade gets 409 ``session_owned_elsewhere``
naming the owner.
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import aiohttp
import orjson
import structlog
from aiohttp import web

from core.errors import OwnedElsewhere, OwnerLost
from gateway import keys, sse
from gateway.error_responses import ANTHROPIC_PATHS, Handler, anthropic_body, error_body
from gateway.wire.openai_responses.encoder import failed_events

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
        manager = request.app[keys.MANAGER]
        url = await manager.owner_address(exc.replica_id)
        if url is not None:
            try:
                return await forward(request, url)
            except _NotStarted as err:
                log.warning("owner_unreachable", owner=exc.replica_id, error=str(err.__cause__ or err))
        if not await manager.take_over(exc.key, exc.replica_id):
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
    tail = StreamTail(request.path)
    try:
        async for chunk in upstream.content.iter_any():
            await resp.write(chunk)
            tail.feed(chunk)
    except aiohttp.ClientError as exc:
        log.warning("owner_lost", streaming=True, error=str(exc))
        await resp.write(tail.end(OwnerLost("the replica serving this session stopped mid-stream; retry the "
                                            "request (the session continues on a live replica)")))
    await resp.write_eof()
    log.info("forwarded", to=str(upstream.url.origin()), status=upstream.status, streaming=True)
    return resp


class StreamTail:
    """What a relayed stream has said so far: enough to end it in its own protocol's words
    when the owner dies mid-stream.  Anthropic clients act on ``event: error`` and ignore a bare
    ``data:`` error; Responses clients wait for ``response.failed`` (numbered after the last
    relayed event, on the response ``response.created`` announced); Chat ends with ``[DONE]``."""

    _SEQ = re.compile(rb'"sequence_number":\s*(\d+)')

    def __init__(self, path: str) -> None:
        self.path = path
        self.last = b"\n\n"  # the last two bytes relayed: at an event boundary or not
        self.line = b""  # a Responses line not yet complete
        self.shell: dict[str, Any] | None = None
        self.seq = -1

    def feed(self, chunk: bytes) -> None:
        self.last = (self.last + chunk)[-2:]
        if not self.path.startswith("/v1/responses"):
            return
        *lines, self.line = (self.line + chunk).split(b"\n")
        for line in lines:
            if m := self._SEQ.search(line):
                self.seq = max(self.seq, int(m.group(1)))
            if self.shell is None and b'"response.created"' in line and line.startswith(b"data: "):
                with contextlib.suppress(orjson.JSONDecodeError):
                    self.shell = orjson.loads(line[6:]).get("response")

    def end(self, exc: BaseException) -> bytes:
        boundary = b"" if self.last == b"\n\n" else b"\n\n"
        if self.path.startswith(ANTHROPIC_PATHS):
            return boundary + sse.frame(anthropic_body(exc)[1], event="error")
        if self.path.startswith("/v1/responses"):
            return boundary + b"".join(failed_events(self.shell or {"object": "response"}, self.seq + 1, exc))
        return boundary + sse.frame(error_body(exc)[1]) + sse.frame("[DONE]")


async def tag_replica(request: web.Request, response: web.StreamResponse) -> None:
    """Every response names the replica that produced it (a proxied one keeps its owner's)."""
    response.headers.setdefault(REPLICA, request.app[keys.REPLICA_ID])
