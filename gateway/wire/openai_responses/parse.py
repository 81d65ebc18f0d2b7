"""A Responses body as the internal :class:`~gateway.chat_request.ChatRequest`.

``input`` items become chat messages (``message`` items as they are, ``function_call``
items as an assistant's ``tool_calls``, ``function_call_output`` items as ``role: tool``),
with ``instructions`` as the system message."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog
from aiohttp import web

from core.errors import InvalidRequest
from gateway import chat_messages as wire
from gateway import chat_request, client_hints, keys
from gateway.chat_request import ChatRequest

log = structlog.get_logger("specgate.http")
TEXT_PARTS = ("input_text", "output_text", "text", "refusal")
# the fields read here; the rest (reasoning, include, client_metadata, service_tier, truncation, ...) have
# no meaning on this server and are ignored with a debug log
KNOWN_FIELDS = frozenset({"model", "input", "instructions", "tools", "tool_choice", "stream", "max_output_tokens",
                          "temperature", "top_p", "parallel_tool_calls", "text", "store", "metadata", "user",
                          "prompt_cache_key", "previous_response_id", "background", "conversation", "specprefill",
                          "speculative", "specattn", "lookup"})
ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id",
          "temperature", "top_p", "user", "prompt_cache_key")


@dataclass(slots=True, frozen=True)
class ResponsesRequest:
    chat: ChatRequest
    previous_response_id: str | None
    store: bool
    instructions: str | None
    echo: dict[str, Any]  # request fields a response object repeats back


def parse(body: Any, request: web.Request, history: list[dict[str, Any]]) -> ResponsesRequest:
    config = request.app[keys.CONFIG]
    return parse_body(body, history, request.app[keys.DEFAULTS], config.gateway.limits, config.engine.context_limit,
                      client_hints.header_hint(request.headers))


def parse_body(body: Any, history: list[dict[str, Any]], defaults: Any, limits: Any, n_ctx: int,
               header_hint: str | None = None) -> ResponsesRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if ignored := sorted(set(body) - KNOWN_FIELDS):
        log.debug("fields_ignored", protocol="responses", fields=ignored)
    for key in ("background", "conversation"):
        if body.get(key):
            raise InvalidRequest(f"'{key}' is not supported by this server")
    fmt = body["text"].get("format") if isinstance(body.get("text"), dict) else None
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise InvalidRequest("'instructions' must be a string")
    if "input" not in body:
        raise InvalidRequest("'input' is required: a string or a list of items")
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + history + items(body["input"])
    tools = wire.function_tools(body.get("tools"), lambda t: t.get("type") == "function", "parameters")
    chat_body = {"messages": messages, "tools": tools, "model": body.get("model"),
                 "tool_choice": _tool_choice(body.get("tool_choice")), "stream": body.get("stream"),
                 "max_tokens": body.get("max_output_tokens"), "temperature": body.get("temperature"),
                 "top_p": body.get("top_p"), "specprefill": body.get("specprefill"),
                 "speculative": body.get("speculative"), "specattn": body.get("specattn"), "lookup": body.get("lookup"),
                 "parallel_tool_calls": body.get("parallel_tool_calls"), "response_format": _format(fmt),
                 "prompt_cache_key": body.get("prompt_cache_key"), "user": body.get("user")}
    chat = chat_request.parse_chat({k: v for k, v in chat_body.items() if v is not None}, defaults, None, limits, n_ctx,
                               header_hint)
    metadata = body.get("metadata")
    if metadata is not None and not (isinstance(metadata, dict) and len(metadata) <= 16
                                     and all(isinstance(v, str) and len(v) <= 512 for v in metadata.values())):
        raise InvalidRequest("'metadata' must be an object of at most 16 string values (512 characters each)")
    store = body.get("store", True)
    if not isinstance(store, bool):
        raise InvalidRequest("'store' must be a boolean")
    echo = {k: body.get(k) for k in ECHOED} | {"tools": body.get("tools") or [], "format": fmt,
                                                "tool_choice": body.get("tool_choice", "auto")}
    return ResponsesRequest(chat, body.get("previous_response_id"), store, instructions, echo)


def items(raw: Any) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message."""
    if isinstance(raw, str):
        return [{"role": "user", "content": raw}]
    if not isinstance(raw, list):
        raise InvalidRequest("'input' must be a string or a list of items")
    out: list[dict[str, Any]] = []
    for i, item in enumerate(raw):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"{where} must be an object")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            content = wire.join_text(item.get("content"), f"{where}.content", TEXT_PARTS)
            out.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            _function_call(out, item, where)
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise InvalidRequest(f"{where}.call_id must be a string")
            out.append({"role": "tool", "tool_call_id": item["call_id"],
                        "content": wire.join_text(item.get("output", ""), f"{where}.output", TEXT_PARTS)})
        elif kind == "reasoning":
            continue  # a reasoning model's own summary, sent back: nothing to render
        else:
            raise InvalidRequest(f"{where}.type {kind!r} is not supported; expected message, function_call or "
                                 "function_call_output")
    return out


def _function_call(out: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    """A call joins the assistant message before it, as chat templates render one turn."""
    if not isinstance(item.get("name"), str) or not isinstance(item.get("call_id"), str):
        raise InvalidRequest(f"{where} must have string 'call_id' and 'name'")
    args = item.get("arguments", "{}")
    if not isinstance(args, str):
        raise InvalidRequest(f"{where}.arguments must be a JSON string")
    call = {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": args}}
    if out and out[-1]["role"] == "assistant":
        out[-1].setdefault("tool_calls", []).append(call)
        return
    out.append({"role": "assistant", "content": None, "tool_calls": [call]})


def _format(fmt: Any) -> Any:
    """``text.format`` in chat's ``response_format`` form (the schema sits one level up here)."""
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name"), "schema": fmt.get("schema"),
                                                       "strict": fmt.get("strict")}}
    return fmt


def _tool_choice(choice: Any) -> Any:
    if choice is None or isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}")
