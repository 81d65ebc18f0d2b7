"""Server-sent events: the one streaming loop every protocol's stream runs through.

A protocol supplies an :class:`Encoder` that turns the turn's moments -- start,
each text piece, the finished :class:`~gateway.chat_request.TurnResult`, or a
failure after the headers went out -- into its own SSE frames.  The loop
owns what is the same everywhere: the headers, writing, a keepalive whenever the
stream has been quiet for ``keepalive_s`` (a prefill of a long prompt takes minutes
on a CPU; proxies and clients cut idle streams), and a client that goes away
(counted, logged, and the turn stopped at its next token).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, Protocol

import orjson
import structlog
from aiohttp import web

from gateway import keys
from gateway.chat_request import TurnResult
from gateway.tool_calls import CallArgs, CallStart, Piece
from gateway.turns import Turn

log = structlog.get_logger("specgate.http")
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def frame(data: dict[str, Any] | str, event: str | None = None) -> bytes:
    """One SSE frame: ``event: <name>`` (when the protocol names its events) and ``data:``."""
    payload = data if isinstance(data, str) else orjson.dumps(data).decode()
    return (f"event: {event}\n" if event else "").encode() + f"data: {payload}\n\n".encode()


class Encoder(Protocol):
    async def settle(self, result: TurnResult) -> None: ...  # what must be done before the last event
    def start(self) -> list[bytes]: ...
    def text(self, piece: str) -> list[bytes]: ...
    def call(self, piece: CallStart | CallArgs) -> list[bytes]: ...  # a tool call as it is written
    def finish(self, result: TurnResult) -> list[bytes]: ...
    def error(self, exc: BaseException) -> list[bytes]: ...
    def keepalive(self) -> list[bytes]: ...  # Anthropic's ping event; an SSE comment elsewhere


COMMENT = b": keepalive\n\n"  # an SSE comment: every client's parser skips it


async def stream(request: web.Request, turn: Turn, encoder: Encoder,
                 headers: dict[str, str] | None = None) -> web.StreamResponse:
    config = request.app[keys.CONFIG].gateway
    resp = web.StreamResponse(headers={**HEADERS, **(headers or {})})
    lock = asyncio.Lock()  # the keepalive task writes too: whole frames, one writer at a time
    loop = asyncio.get_running_loop()
    last = loop.time()

    async def send(frames: list[bytes]) -> None:
        nonlocal last
        if frames:
            async with lock:
                await resp.write(b"".join(frames))
                last = loop.time()

    async def keepalive(every: float) -> None:
        with contextlib.suppress(ConnectionError):  # the client left: the main loop sees it too
            while True:
                await asyncio.sleep(max(0.0, last + every - loop.time()))
                if loop.time() - last >= every:
                    await send(encoder.keepalive())

    pinger: asyncio.Task[None] | None = None
    pieces = aiter(turn.pieces())
    try:
        first = await _held(request, turn, pieces, config.stream_hold_s, config.keepalive_s)
        await resp.prepare(request)
        await send(encoder.start())
        pinger = asyncio.create_task(keepalive(config.keepalive_s))
        piece = await first
        while piece is not _END:
            await send(encoder.text(piece) if isinstance(piece, str) else encoder.call(piece))
            piece = await anext(pieces, _END)
        try:
            result = await turn.result()
        except Exception as exc:  # headers are out: report in-band
            log.warning("stream_error", error=str(exc), error_type=type(exc).__name__)
            await send(encoder.error(exc))
            return resp
        await encoder.settle(result)
        await send(encoder.finish(result))
        async with lock:  # no keepalive after the last frame
            pinger.cancel()
            await resp.write_eof()
    except (ConnectionResetError, ConnectionError, asyncio.CancelledError) as exc:
        request.app[keys.METRICS].disconnects.labels("sse").inc()
        log.info("client_disconnected", stream=True, error=type(exc).__name__)
        if isinstance(exc, asyncio.CancelledError):
            raise
    finally:
        if pinger is not None:
            pinger.cancel()
        turn.abandon()
    return resp


_END: Any = object()  # the turn wrote its last piece


async def _held(request: web.Request, turn: Turn, pieces: AsyncIterator[Piece], hold_s: float,
                poll_s: float) -> asyncio.Future[Piece]:
    """Wait up to ``hold_s`` for the turn's first piece before any byte goes out: until then a
    balancer that sees this replica die can replay the request on another one.  A turn that
    fails first raises here, so the client gets the error's own status, not a stream.
    Returns the (perhaps pending) first piece; ``ConnectionResetError`` if the client left."""
    first: asyncio.Future[Piece] = asyncio.ensure_future(anext(pieces, _END))
    deadline = asyncio.get_running_loop().time() + hold_s
    while not first.done():
        left = deadline - asyncio.get_running_loop().time()
        if left <= 0:
            return first
        await asyncio.wait({first}, timeout=min(left, poll_s))
        if request.transport is None or request.transport.is_closing():
            first.cancel()
            raise ConnectionResetError("the client left before the first token")
    if first.result() is _END:  # no piece at all: a failed turn raises, for its own status
        await turn.result()
    return first
