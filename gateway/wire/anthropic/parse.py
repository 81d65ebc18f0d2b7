"""An Anthropic Messages body as the internal :class:`~gateway.chat_request.ChatRequest`.

``system`` becomes a system message, ``text`` blocks content, ``tool_use``
blocks an assistant's ``tool_calls`` (arguments as JSON), ``tool_result``
blocks ``role: tool`` messages, and ``tools``' ``input_schema`` a function's
``parameters``.  ``cache_control`` is accepted and ignored, since SpecGate keeps every
session's KV anyway, and reuse is reported as ``usage.cache_read_input_tokens``."""

from __future__ import annotations

from typing import Any

import orjson
import structlog
from aiohttp import web

from core.config import DEFAULT_LIMITS, Limits
from core.errors import InvalidRequest
from core.policies import TurnParams
from gateway import chat_messages as wire
from gateway import chat_request, client_hints, keys
from gateway.chat_request import ChatRequest

log = structlog.get_logger("specgate.http")
# a model's own reasoning sent back, and server-tool blocks (run by Anthropic's servers, not here): not rendered
IGNORED_BLOCKS = ("thinking", "redacted_thinking", "server_tool_use", "web_search_tool_result",
                  "web_fetch_tool_result", "code_execution_tool_result", "container_upload")
# the fields read here; the rest (thinking, context_management, output_config, service_tier, container,
# mcp_servers, betas, ...) have no meaning on this server and are ignored with a debug log
KNOWN_FIELDS = frozenset({"model", "messages", "system", "tools", "tool_choice", "max_tokens", "stream",
                          "temperature", "top_p", "top_k", "stop_sequences", "metadata", "session_id", "specprefill",
                          "speculative", "specattn", "lookup"})


def parse(body: Any, request: web.Request) -> ChatRequest:
    config = request.app[keys.CONFIG]
    return parse_messages_body(body, request.app[keys.DEFAULTS], request.headers.get(client_hints.SESSION_HEADER),
                               config.gateway.limits, config.engine.context_limit,
                               client_hints.header_hint(request.headers), config.gateway.keep_billing_header)


def parse_messages_body(body: Any, defaults: TurnParams, header_session: str | None,
                        limits: Limits = DEFAULT_LIMITS, n_ctx: int = 8192, header_hint: str | None = None,
                        keep_billing: bool = False) -> ChatRequest:
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if not isinstance(body.get("max_tokens"), int) or isinstance(body.get("max_tokens"), bool):
        raise InvalidRequest("'max_tokens' is required and must be an integer")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list")
    if ignored := sorted(set(body) - KNOWN_FIELDS):
        log.debug("fields_ignored", protocol="anthropic", fields=ignored)
    system = _system(body.get("system"), keep_billing)
    chat: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for i, m in enumerate(raw):
        chat += _message(m, f"messages[{i}]")
    tools = wire.function_tools(body.get("tools"), _runnable, "input_schema")
    choice = _tool_choice(body.get("tool_choice"))
    chat_body = {
        "messages": chat, "tools": tools, "tool_choice": choice, "model": body.get("model"),
        "stream": body.get("stream"), "max_tokens": body["max_tokens"], "temperature": body.get("temperature"),
        "top_p": body.get("top_p"), "top_k": body.get("top_k"), "stop": body.get("stop_sequences"),
        "session_id": body.get("session_id"), "specprefill": body.get("specprefill"),
        "speculative": body.get("speculative"), "specattn": body.get("specattn"), "lookup": body.get("lookup"),
        "user": client_hints.anthropic_user_hint(_user_id(body.get("metadata"))),
        "parallel_tool_calls": False if isinstance(body.get("tool_choice"), dict)
        and body["tool_choice"].get("disable_parallel_tool_use") is True else None,
    }
    return chat_request.parse_chat({k: v for k, v in chat_body.items() if v is not None}, defaults, header_session,
                               limits, n_ctx, header_hint)


def _runnable(tool: dict[str, Any]) -> bool:
    """A client-side tool the model may call now: not a server tool (web search, code
    execution: no ``input_schema``), nor one deferred until a tool search loads it."""
    return "input_schema" in tool and tool.get("defer_loading") is not True


def _user_id(metadata: Any) -> Any:
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        raise InvalidRequest("'metadata' must be an object")
    return metadata.get("user_id")


def _system(system: Any, keep_billing: bool) -> str:
    """The system prompt, without Claude Code's leading billing line unless kept."""
    if not system:
        return ""
    text = wire.join_text(system, "system")
    if keep_billing:
        return text
    if isinstance(system, list) and system and isinstance(system[0], dict):  # the line is the first block
        first, found = client_hints.strip_billing_line(system[0].get("text") or "")
        text = wire.join_text([{**system[0], "text": first}, *system[1:]], "system") if found else text
    else:
        text, found = client_hints.strip_billing_line(text)
    if found:
        log.debug("billing_line_stripped")
    return text


def _message(m: Any, where: str) -> list[dict[str, Any]]:
    """One Anthropic message as OpenAI chat messages: tool results become ``role: tool``; a
    ``system`` entry (Claude Code's environment context) stays where it is in the conversation
    (core.chat folds it into the system prompt when the template cannot place it there)."""
    if not isinstance(m, dict) or m.get("role") not in ("user", "assistant", "system"):
        raise InvalidRequest(f"{where} must be an object with role 'user', 'assistant' or 'system'")
    role, content = m["role"], m.get("content")
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    if not isinstance(content, list):
        raise InvalidRequest(f"{where}.content must be a string or a list of content blocks")
    out: list[dict[str, Any]] = []
    text: list[str] = []
    calls: list[dict[str, Any]] = []
    for k, block in enumerate(content):
        at = f"{where}.content[{k}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
        elif kind == "tool_use" and role == "assistant":
            calls.append(_tool_use(block, at))
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise InvalidRequest(f"{at}.tool_use_id must be a string")
            result = block.get("content", "")
            body = wire.join_text(result, f"{at}.content") if result else ""
            out.append({"role": "tool", "tool_call_id": block["tool_use_id"],
                        "content": f"Error: {body}" if block.get("is_error") else body})
        elif kind in wire.UNREADABLE:
            text.append(wire.placeholder(kind))
        elif kind in IGNORED_BLOCKS:
            continue
        else:
            raise InvalidRequest(f"{at} must be a text, tool_use (assistant) or tool_result (user) block, "
                                 f"got {kind!r}")
    if text or calls or not out:
        msg: dict[str, Any] = {"role": role, "content": "".join(text) if text or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    return out


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("name"), str) or not isinstance(block.get("id"), str):
        raise InvalidRequest(f"{where} must have string 'id' and 'name'")
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise InvalidRequest(f"{where}.input must be an object")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": orjson.dumps(args).decode()}}


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise InvalidRequest("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"tool\" | \"none\"}")
