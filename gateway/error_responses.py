"""The one place SpecGate exceptions become HTTP and WebSocket error responses."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web

from core.errors import OwnerLost, PromptTooLong, QueueFull, SpecGateError, Unauthorized

log = structlog.get_logger("specgate.http")
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
REJECTED: web.AppKey[Callable[[str], None]] = web.AppKey("on_rejected")  # counts refused requests by code


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    if isinstance(exc, PromptTooLong):  # OpenAI's words and code, which clients (Codex) act on
        return 400, {"error": {"message": f"This model's maximum context length is {exc.n_ctx} tokens. However, "
                                          f"your messages resulted in {exc.n_tokens} tokens. Please reduce the "
                                          "length of the messages.", "type": "invalid_request_error",
                               "param": "messages", "code": exc.code}}
    if isinstance(exc, SpecGateError):
        status, code, message = exc.status, exc.code, str(exc)
    elif isinstance(exc, web.HTTPRequestEntityTooLarge):
        status, code, message = 413, "body_too_large", "request body too large"
    else:
        status, code, message = 500, "internal_error", f"internal error: {type(exc).__name__}"
    kind = "invalid_request_error" if status < 500 else "server_error"
    return status, {"error": {"message": message, "type": kind, "code": code}}


# Anthropic's error types by status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   503: "overloaded_error"}
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """The same error in Anthropic's shape: ``{"type": "error", "error": {"type", "message"}}``
    (SpecGate's own ``code`` rides along)."""
    status, body = error_body(exc)
    kind = ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    message = body["error"]["message"]
    if isinstance(exc, PromptTooLong):  # Anthropic's words: Claude Code offers /compact on them
        message = f"prompt is too long: {exc.n_tokens} tokens > {exc.n_ctx} maximum"
    return status, {"type": "error", "error": {"type": kind, "message": message, "code": body["error"]["code"]}}


def ws_error(exc: BaseException) -> dict[str, Any]:
    _, body = error_body(exc)
    return {"type": "error", "code": body["error"]["code"], "message": body["error"]["message"]}


def json_error(exc: BaseException, path: str = "") -> web.Response:
    status, body = anthropic_body(exc) if path.startswith(ANTHROPIC_PATHS) else error_body(exc)
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
            return json_error(exc, request.path)
        if exc.status >= 400:
            message = exc.reason
            if exc.status == 404 and request.match_info.http_exception is not None:  # no such route
                message = f"no route {request.method} {request.path}; this server serves {routes_of(request.app)}"
                log.info("request_error", path=request.path, status=404, code="not_found", error=message)
            status, code = exc.status, exc.reason.lower().replace(" ", "_")
            kept = {k: v for k, v in exc.headers.items() if k in ("Allow", "Retry-After")}  # 405 names methods
            body: dict[str, Any] = {"error": {"message": message, "type": "invalid_request_error", "code": code}}
            if request.path.startswith(ANTHROPIC_PATHS):
                body = {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(status, "invalid_request_error"),
                                                   "message": message, "code": code}}
            return web.json_response(body, status=status, headers=kept)
        raise
    except SpecGateError as exc:
        (log.error if exc.status >= 500 else log.info)("request_error", path=request.path, status=exc.status,
                                                       code=exc.code, error=str(exc))
        if (on_reject := request.app.get(REJECTED)) is not None:
            on_reject(exc.code)
        return json_error(exc, request.path)
    except Exception as exc:
        log.exception("unhandled_error", path=request.path)
        return json_error(exc, request.path)


def routes_of(app: web.Application) -> str:
    seen = sorted({f"{r.method} {r.resource.canonical}" for r in app.router.routes()
                   if r.resource is not None and r.method not in ("HEAD", "*")})
    return ", ".join(seen)
