"""JSON bodies in and out: one reader that names what is wrong with a body, one writer."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

import orjson
from aiohttp import web

from core.errors import InvalidRequest, UnsupportedMediaType

T = TypeVar("T")
BIG_BODY = 1 << 20  # a body this large is decoded off the event loop


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on a worker thread: parsing a body of up to ``--max-body-mb`` (megabytes
    of JSON, a forced call's grammar compiled) must not hold the event loop, and every
    stream on it."""
    return await asyncio.to_thread(fn, *args)


async def read_json(request: web.Request) -> Any:
    """The body as JSON.  It must say it is JSON: a web page can POST ``text/plain`` (or a
    form) anywhere without a CORS preflight, but never ``application/json``."""
    raw = await request.read()
    if not raw:
        raise InvalidRequest("the request body is empty; expected JSON")
    kind = request.content_type
    if kind != "application/json" and not kind.endswith("+json"):
        raise UnsupportedMediaType(f"the request body must be JSON, sent as Content-Type: application/json "
                                   f"(got {request.headers.get('Content-Type', 'none')!r})")
    try:
        return await off_loop(orjson.loads, raw) if len(raw) > BIG_BODY else orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from exc


def dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(obj, status=status, headers=headers, dumps=dumps)
