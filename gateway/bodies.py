"""JSON bodies in and out: one reader that names what is wrong with a body, one writer."""

from __future__ import annotations

from typing import Any

import orjson
from aiohttp import web

from core.errors import InvalidRequest


async def read_json(request: web.Request) -> Any:
    raw = await request.read()
    if not raw:
        raise InvalidRequest("the request body is empty; expected JSON")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"malformed JSON body: {exc}") from exc


def dumps(obj: Any) -> str:
    return orjson.dumps(obj).decode()


def json_response(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response(obj, status=status, headers=headers, dumps=dumps)
