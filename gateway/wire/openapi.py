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
# SpecGate's own request fields, read on every route (gateway.chat_request)
_EXTENSIONS = {"specprefill": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
               "speculative": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
               "specattn": {"oneOf": [{"type": "boolean"}, {"type": "object"}]},
               "lookup": {"type": "boolean"}}
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
    **_EXTENSIONS,
}}
_TEXT_BLOCK = {"type": "object", "required": ["type", "text"], "properties": {
    "type": {"type": "string", "enum": ["text"]}, "text": {"type": "string", "maxLength": 2000}}}
_BLOCK = {"type": "object", "required": ["type"], "properties": {
    "type": {"type": "string", "enum": ["text", "tool_use", "tool_result"]}, "text": {"type": "string"},
    "id": {"type": "string"}, "name": {"type": "string"}, "input": {"type": "object"},
    "tool_use_id": {"type": "string"}, "content": {"type": "string"}, "is_error": {"type": "boolean"}}}
_A_MESSAGE = {"type": "object", "required": ["role", "content"], "properties": {
    "role": {"type": "string", "enum": ["user", "assistant", "system"]},
    "content": {"oneOf": [{"type": "string", "maxLength": 2000}, {"type": "array", "items": _BLOCK, "maxItems": 4}]}}}
_A_TOOL = {"type": "object", "required": ["name", "input_schema"], "properties": {
    "name": {"type": "string"}, "description": {"type": "string"}, "input_schema": {"type": "object"}}}
_MESSAGES = {"type": "object", "required": ["model", "max_tokens", "messages"], "properties": {
    "model": {"type": "string"}, "max_tokens": {"type": "integer", "minimum": 1, "maximum": 8},
    "messages": {"type": "array", "items": _A_MESSAGE, "minItems": 1, "maxItems": 8},
    "system": {"oneOf": [{"type": "string"}, {"type": "array", "items": _TEXT_BLOCK}]},
    "tools": {"type": "array", "items": _A_TOOL},
    "tool_choice": {"type": "object", "required": ["type"], "properties": {
        "type": {"type": "string", "enum": ["auto", "any", "tool", "none"]}, "name": {"type": "string"}}},
    "stop_sequences": {"type": "array", "items": {"type": "string"}}, "stream": {"type": "boolean"},
    "temperature": {"type": "number"}, "top_p": {"type": "number"}, "top_k": {"type": "integer"},
    "metadata": {"type": "object", "properties": {"user_id": {"type": "string"}}}, **_EXTENSIONS}}
_ITEM = {"type": "object", "properties": {
    "type": {"type": "string", "enum": ["message", "function_call", "function_call_output"]},
    "role": {"type": "string", "enum": ["user", "assistant", "system", "developer"]},
    "content": {"type": "string", "maxLength": 2000}, "call_id": {"type": "string"}, "name": {"type": "string"},
    "arguments": {"type": "string"}, "output": {"type": "string"}}}
_R_TOOL = {"type": "object", "required": ["type", "name"], "properties": {
    "type": {"type": "string", "enum": ["function"]}, "name": {"type": "string"},
    "description": {"type": "string"}, "parameters": {"type": "object"}}}
_RESPONSE = {"type": "object", "required": ["input"], "properties": {
    "model": {"type": "string"}, "instructions": {"type": "string"},
    "input": {"oneOf": [{"type": "string", "maxLength": 2000}, {"type": "array", "items": _ITEM, "maxItems": 8}]},
    "previous_response_id": {"type": "string"}, "tools": {"type": "array", "items": _R_TOOL},
    "tool_choice": {"oneOf": [{"type": "string", "enum": ["auto", "none", "required"]}, {"type": "object"}]},
    "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 8}, "stream": {"type": "boolean"},
    "store": {"type": "boolean"}, "temperature": {"type": "number"}, "top_p": {"type": "number"},
    "metadata": {"type": "object", "additionalProperties": {"type": "string"}}, **_EXTENSIONS}}
_RESPONSE_ID = {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}}


def _post(operation: str, schema: dict[str, Any], stream: bool = False) -> dict[str, Any]:
    content = {"application/json": {"schema": {"type": "object"}}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"post": {"operationId": operation,
                     "requestBody": {"required": True, "content": {"application/json": {"schema": schema}}},
                     "responses": {**_RESPONSES, "200": {"description": "ok", "content": content}}}}


_RESPONSES = {"200": _JSON_OK, "400": _ERROR, "401": _ERROR, "404": _ERROR, "409": _ERROR, "413": _ERROR,
              "429": _ERROR, "503": _ERROR}
_SESSION_ID = {"name": "id", "in": "path", "required": True, "schema": _ID}
_SESSION_HEADER = {"name": "X-SpecGate-Session", "in": "header", "required": False, "schema": _ID}

SPEC: dict[str, Any] = {
    "openapi": "3.0.3",
    "info": {"title": "SpecGate", "version": "0.1.0"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"},
                                       "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
    "security": [{"bearer": []}],
    "paths": {
        "/v1/chat/completions": {"post": {
            "operationId": "chat", "parameters": [_SESSION_HEADER],
            "requestBody": {"required": True, "content": {"application/json": {"schema": _CHAT}}},
            "responses": {**_RESPONSES, "200": {"description": "a completion, or an SSE stream", "content": {
                "application/json": {"schema": {"type": "object"}},
                "text/event-stream": {"schema": {"type": "string"}}}}}}},
        "/v1/messages": _post("messages", _MESSAGES, stream=True),
        "/v1/messages/count_tokens": _post("count_tokens", _MESSAGES),
        "/v1/responses": _post("responses", _RESPONSE, stream=True),
        "/v1/responses/input_tokens": _post("response_input_tokens", _RESPONSE),
        "/v1/responses/{id}": {
            "get": {"operationId": "get_response", "parameters": [_RESPONSE_ID], "responses": _RESPONSES},
            "delete": {"operationId": "delete_response", "parameters": [_RESPONSE_ID], "responses": _RESPONSES}},
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
