"""Qwen-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson

OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)


def parse(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content, OpenAI tool_calls)."""
    if OPEN not in text:
        return text, []
    calls = []
    for body in _CALL.findall(text):
        try:
            obj = orjson.loads(body)
        except orjson.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else orjson.dumps(args).decode()},
        })
    if not calls:
        return text, []
    content = text[: text.index(OPEN)].strip()
    return (content or None), calls


def for_template(message: dict[str, Any]) -> dict[str, Any]:
    """OpenAI assistant messages carry arguments as JSON strings; templates want objects."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        fn = dict(call.get("function") or {})
        if isinstance(fn.get("arguments"), str):
            try:
                fn["arguments"] = orjson.loads(fn["arguments"])
            except orjson.JSONDecodeError:
                pass
        fixed.append({**call, "function": fn, **fn})
    return {**message, "tool_calls": fixed, "content": message.get("content") or ""}
