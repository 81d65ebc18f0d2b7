"""Chat messages and tool definitions off the wire: typed, bounded, and reduced to the
fields SpecGate knows, so what a session stores is exactly what it can render.

Every error names the offending field; a request over a size limit is a
:class:`~core.errors.RequestTooLarge` (413) that names the limit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
import structlog

from core.config import Limits
from core.errors import InvalidRequest, RequestTooLarge

log = structlog.get_logger("specgate.http")
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system


def _str(value: Any, where: str, optional: bool = True) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{where} must be a string")
    return value


def _content(value: Any, where: str) -> str | None:
    """A string, null, or OpenAI's list of text parts (joined)."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        parts: list[str | None] = []
        for i, part in enumerate(value):
            if isinstance(part, dict) and part.get("type") in UNREADABLE:
                parts.append(placeholder(part["type"]))
                continue
            if not isinstance(part, dict) or part.get("type") != "text":
                raise InvalidRequest(f"{where}[{i}] must be a text part {{\"type\": \"text\", \"text\": ...}}")
            parts.append(_str(part.get("text"), f"{where}[{i}].text", optional=False))
        return "".join(p for p in parts if p)
    raise InvalidRequest(f"{where} must be a string, a list of text parts, or null")


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        raise InvalidRequest(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{...}}}}")
    if call.get("type", "function") != "function":
        raise InvalidRequest(f"{where}.type must be 'function'")
    fn = call["function"]
    arguments = fn.get("arguments", "{}")
    if not isinstance(arguments, str | dict):
        raise InvalidRequest(f"{where}.function.arguments must be a JSON string")
    return {"id": _str(call.get("id"), f"{where}.id") or "", "type": "function",
            "function": {"name": _str(fn.get("name"), f"{where}.function.name", optional=False),
                         "arguments": arguments}}


def parse_message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise InvalidRequest(f"{where} must be an object")
    role = m.get("role")
    if role not in ROLES:
        raise InvalidRequest(f"{where}.role must be one of {ROLES}, got {role!r}")
    out: dict[str, Any] = {"role": "system" if role == "developer" else role,
                           "content": _content(m.get("content"), f"{where}.content")}
    calls = m.get("tool_calls")
    if calls is not None:
        if role != "assistant" or not isinstance(calls, list):
            raise InvalidRequest(f"{where}.tool_calls must be a list, on an assistant message")
        if calls:
            out["tool_calls"] = [_tool_call(c, f"{where}.tool_calls[{k}]") for k, c in enumerate(calls)]
    if out["content"] is None and "tool_calls" not in out:
        raise InvalidRequest(f"{where}.content is required")
    for key in ("name", "tool_call_id"):
        if (value := _str(m.get(key), f"{where}.{key}")) is not None:
            out[key] = value
    return out


def size(message: dict[str, Any]) -> int:
    """Characters a message brings before templating."""
    n = len(message.get("content") or "")
    for call in message.get("tool_calls", ()):
        args = call["function"]["arguments"]
        n += len(call["function"]["name"]) + (len(args) if isinstance(args, str) else len(str(args)))
    return n


def parse_messages(raw: Any, limits: Limits, n_ctx: int, tool_chars: int = 0) -> tuple[dict[str, Any], ...]:
    """``tool_chars``: the characters of the request's tool definitions, which the template
    renders into the prompt too and count toward the same bound (:func:`tools_size`)."""
    if not isinstance(raw, list) or not raw:
        raise InvalidRequest("'messages' must be a non-empty list")
    if len(raw) > limits.max_messages:
        raise RequestTooLarge(f"{len(raw)} messages; this server takes at most {limits.max_messages} (max_messages)")
    messages = tuple(parse_message(m, i) for i, m in enumerate(raw))
    cap = limits.max_prompt_chars or 16 * n_ctx
    if (total := sum(size(m) for m in messages) + tool_chars) > cap:
        what = "messages and tools hold" if tool_chars else "messages hold"
        raise RequestTooLarge(f"{what} {total} characters; this server takes at most {cap} (max_prompt_chars)")
    return messages


def tools_size(tools: tuple[dict[str, Any], ...] | None) -> int:
    """Characters the tool definitions bring (their JSON, as templates render them)."""
    return len(orjson.dumps(tools)) if tools else 0


def depth(value: Any, limit: int) -> int:
    """JSON nesting depth of ``value``, counted without recursion and stopped past ``limit``."""
    deepest = 0
    stack = [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict | list):
            deepest = max(deepest, d)
            if deepest > limit:
                return deepest
            stack.extend((child, d + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_tools(body: dict[str, Any], limits: Limits) -> tuple[dict[str, Any], ...] | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if choice is not None and not isinstance(choice, str | dict):
        raise InvalidRequest("'tool_choice' must be a string or an object")
    if tools is None or choice == "none":
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and t.get("type") == "function" and isinstance(t.get("function"), dict)
            and isinstance(t["function"].get("name"), str) for t in tools):
        raise InvalidRequest("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}")
    if depth(tools, limits.max_tool_depth + 3) > limits.max_tool_depth + 3:  # list > tool > function > schema
        raise RequestTooLarge(f"tool definitions nest deeper than {limits.max_tool_depth} (max_tool_depth)")
    return tuple(tools) or None


def tool_choice(choice: Any, tools: tuple[dict[str, Any], ...] | None) -> str:
    """OpenAI's ``tool_choice`` as one string: ``auto``, ``required``, ``none`` or the name of
    the one function the reply must call, which must be among ``tools``."""
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("auto", "required", "none"):
            raise InvalidRequest(f"'tool_choice' must be 'auto', 'required', 'none' or a function, got {choice!r}")
        if choice == "required" and not tools:
            raise InvalidRequest("'tool_choice' is 'required' but the request offers no tools")
        return choice
    fn = choice.get("function") if isinstance(choice.get("function"), dict) else choice
    name = fn.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise InvalidRequest("'tool_choice' must name a function: {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}")
    offered = [t["function"]["name"] for t in tools or ()]
    if name not in offered:
        raise InvalidRequest(f"'tool_choice' names {name!r}, which is not among the offered tools {offered}")
    return name


# parts a text-only model cannot read: each becomes a short placeholder, so an agent whose tool
# returned a screenshot (Claude Code's Read of an image) goes on instead of failing
UNREADABLE = ("image", "document", "input_image", "input_file", "image_url", "input_audio", "file")


def placeholder(kind: Any) -> str:
    log.debug("part_replaced", part_type=kind)
    return f"[{kind} omitted: this server's models read text only]"


def join_text(content: Any, where: str, kinds: tuple[str, ...] = ("text",)) -> str:
    """A string, or a list of text parts of ``kinds`` joined (another protocol's content);
    parts no text model reads become placeholders."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(f"{where} must be a string or a list of text parts")
    parts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in UNREADABLE:
            parts.append(placeholder(kind))
            continue
        text = part.get("refusal" if kind == "refusal" else "text") if kind in kinds else None
        if not isinstance(text, str):
            raise InvalidRequest(f"{where}[{k}]: {kind!r} parts are not supported here (this server's models "
                                 "read text only)")
        parts.append(text)
    return "".join(parts)


def function_tools(tools: Any, runnable: Callable[[dict[str, Any]], bool],
                   schema_key: str) -> list[dict[str, Any]] | None:
    """Another protocol's tool list as OpenAI chat functions; tools SpecGate cannot run (hosted
    search, shells, ...) are left out with a logged warning, not refused, as agents send them."""
    if tools is None:
        return None
    if not isinstance(tools, list):
        raise InvalidRequest("'tools' must be a list")
    out = []
    for i, t in enumerate(tools):
        if not isinstance(t, dict):
            raise InvalidRequest(f"tools[{i}] must be an object")
        if not runnable(t):
            log.debug("tool_ignored", tool_type=t.get("type"), name=t.get("name"))
            continue
        if not isinstance(t.get("name"), str):
            raise InvalidRequest(f"tools[{i}].name must be a string")
        out.append({"type": "function", "function": {"name": t["name"], "description": t.get("description") or "",
                                                      "parameters": t.get(schema_key) or {}}})
    return out or None
