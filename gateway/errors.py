"""The one place SpecGate exceptions become HTTP and WebSocket error responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from core.errors import OwnerLost, QueueFull, SpecGateError, Unauthorized

log = structlog.get_logger("specgate.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REJECTED: web.AppKey[Callable[[str], None]] = web.AppKey("on_rejected")  # counts refused requests by code


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, SpecGateError):
        status, code, message = exc.status, exc.code, str(exc)
    elif isinstance(exc, web.HTTPRequestEntityTooLarge):
        status, code, message = 413, "body_too_large", "request body too large"
    else:
        status, code, message = 500, "internal_error", f"internal error: {type(exc).__name__}"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "code": code}}


def ws_error(exc: BaseException) -> dict[str, Any]:
    _, body = error_body(exc)
    return {"type": "error", "code": body["error"]["code"], "message": body["error"]["message"]}


def json_error(exc: BaseException) -> web.Response:
    status, body = error_body(exc)
    headers = {}
    if isinstance(exc, QueueFull | OwnerLost):
        headers["Retry-After"] = str(exc.retry_after_s)
    elif isinstance(exc, Unauthorized):
        headers["WWW-Authenticate"] = 'Bearer realm="specgate"'
    return web.json_response(body, status=status, headers=headers)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status == 413:
            return json_error(exc)
        if exc.status >= 400:
            status, code = exc.status, exc.reason.lower().replace(" ", "_")
            kept = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}  # 405 names methods
            return web.json_response({"error": {"message": exc.reason, "type": "invalid_request_error",
                                                "code": code}}, status=status, headers=kept)
        raise
    except SpecGateError as exc:
        (log.error if exc.status >= 500 else log.info)("request_error", path=request.path, status=exc.status,
                                                       code=exc.code, error=str(exc))
        if (on_reject := request.app.get(REJECTED)) is not None:
            on_reject(exc.code)
        return json_error(exc)
    except Exception as exc:
        log.exception("unhandled_error", path=request.path)
        return json_error(exc)
