"""Qwen-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

from __future__ import annotations

import re
import uuid
from typing import Any

import orjson

from core.decoding.stop import StopMatcher

OPEN = "<tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


def _call(obj: Any, names: set[str] | None) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": obj["name"],
                         "arguments": args if isinstance(args, str) else orjson.dumps(args).decode()}}


def _loads(text: str) -> Any:
    """JSON, also in the forms small models write: fenced, or doubled braces (the chat
    template's own example, ``{{"name": ..., "arguments": ...}}``)."""
    text = text.strip()
    if fenced := _FENCE.match(text):
        text = fenced.group(1).strip()
    for candidate in (text, text[1:-1] if text.startswith("{{") and text.endswith("}}") else None):
        if candidate is None:
            continue
        try:
            return orjson.loads(candidate)
        except orjson.JSONDecodeError:
            continue
    return None


def parse(text: str, names: set[str] | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content, OpenAI tool_calls).

    Qwen's format is ``<tool_call>{json}</tool_call>``; small models often answer
    with a bare (or fenced) JSON call instead, accepted when it names a known tool."""
    if OPEN in text:
        calls = [c for body in _CALL.findall(text) if (c := _call(_loads(body), names)) is not None]
        content = text[: text.index(OPEN)].strip() or None
        return (content, calls) if calls else (text, [])
    if names:
        doc = _loads(text)
        items = doc if isinstance(doc, list) else [doc]
        calls = [c for item in items if (c := _call(item, names)) is not None]
        if calls and len(calls) == len(items):
            return None, calls
    return text, []


class StreamFilter:
    """Streamed text of a reply to a request that offered tools.

    Text that may be a call is held back: everything from ``<tool_call>`` on, and a
    reply that opens like bare or fenced JSON.  Once the whole reply is parsed,
    :meth:`release` gives the rest of its content, so the streamed text always adds
    up to the final message's content and a client never sees call syntax."""

    def __init__(self) -> None:
        self._cut = StopMatcher((OPEN,))
        self._seen = ""  # everything fed past the cut
        self._shown = 0  # characters of it already passed on
        self._json_like: bool | None = None

    def feed(self, piece: str) -> str:
        """The part of ``piece`` that is safe to show now."""
        if self._cut.stopped:
            return ""
        self._seen += self._cut.feed(piece)
        if self._json_like is None and self._seen.strip():
            self._json_like = self._seen.lstrip().startswith(("{", "[", "```"))
        if self._json_like is not False:
            return ""
        out, self._shown = self._seen[self._shown:], len(self._seen)
        return out

    def release(self, message: dict[str, Any]) -> str:
        """What is left to show of the final ``message``: nothing when it made calls."""
        content = message.get("content") or ""
        if message.get("tool_calls") or not content.startswith(self._seen[: self._shown]):
            return ""
        return content[self._shown:]


def names_of(tools: Any) -> set[str] | None:
    if not tools:
        return None
    return {t["function"]["name"] for t in tools if isinstance(t.get("function", {}).get("name"), str)}
