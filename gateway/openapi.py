"""``GET /openapi.json``: the HTTP API as an OpenAPI 3.0 document (what the fuzz suite
drives with schemathesis)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

routes = web.RouteTableDef()
_ID = {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}

_ERROR = {"description": "an error", "content": {"application/json": {"schema": {
    "type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "string"}}}}}}}}
_JSON_OK = {"description": "ok", "content": {"application/json": {"schema": {"type": "object"}}}}
_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "user", "assistant", "tool"]},
    "content": {"type": ["string", "null"], "maxLength": 2000},
    "name": {"type": "string"}, "tool_call_id": {"type": "string"},
    "tool_calls": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "string"}, "type": {"type": "string", "enum": ["function"]},
        "function": {"type": "object", "properties": {"name": {"type": "string"},
                                                      "arguments": {"type": "string"}}}}}}}}
_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"type": "string", "enum": ["function"]},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"}, "description": {"type": "string"}, "parameters": {"type": "object"}}}}}
_CHAT = {"type": "object", "required": ["messages"], "properties": {
    "model": {"type": "string"},
    "messages": {"type": "array", "items": _MESSAGE, "minItems": 1, "maxItems": 8},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "top_k": {"type": "integer"},
    "seed": {"type": "integer"},
    "stop": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]},
    "stream": {"type": "boolean"}, "n": {"type": "integer", "enum": [1]},
    "stream_options": {"type": "object", "properties": {"include_usage": {"type": "boolean"}}},
    "tools": {"type": "array", "items": _TOOL}, "tool_choice": {"type": "string"},
    "session_id": _ID,
    "specprefill": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
    "speculative": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
    "specattn": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
}}
_RESPONSES = {"200": _JSON_OK, "400": _ERROR, "401": _ERROR, "404": _ERROR, "409": _ERROR, "413": _ERROR,
              "429": _ERROR, "503": _ERROR}
_SESSION_ID = {"name": "id", "in": "path", "required": True, "schema": _ID}
_SESSION_HEADER = {"name": "X-Session-Id", "in": "header", "required": False, "schema": _ID}

SPEC: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "SpecGate", "version": "0.1.0"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    "security": [{"bearer": []}],
    "paths": {
        "/v1/chat/completions": {"post": {
            "operationId": "chat", "parameters": [_SESSION_HEADER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _CHAT}}},
            "responses": {**_RESPONSES, "200": {"description": "a completion, or an SSE stream", "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}}}}}}},
        "/v1/models": {"get": {"operationId": "models", "responses": {"200": _JSON_OK, "401": _ERROR}}},
        "/v1/sessions": {"post": {
            "operationId": "create_session",
            "requestBody": {"required": False, "content": {"application/json": {"schema": {
                "type": "object", "properties": {"id": _ID}}}}},
            "responses": {**_RESPONSES, "201": _JSON_OK}}},
        "/v1/sessions/{id}": {
            "get": {"operationId": "get_session", "parameters": [_SESSION_ID], "responses": _RESPONSES},
            "delete": {"operationId": "delete_session", "parameters": [_SESSION_ID], "responses": _RESPONSES}},
        "/health": {"get": {"operationId": "health", "security": [], "responses": {"200": _JSON_OK}}},
        "/ready": {"get": {"operationId": "ready", "security": [], "responses": {"200": _JSON_OK, "503": _JSON_OK}}},
    },
}


@routes.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(SPEC)
