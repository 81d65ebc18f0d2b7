"""JSON bodies in and out: one reader that names what is wrong with a body, one writer."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from core.errors import InvalidRequest, UnsupportedMediaType


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
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from exc


def dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(obj, status=status, headers=headers, dumps=dumps)
