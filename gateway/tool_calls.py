"""Qwen-style tool calls: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, parsed
from a finished reply, and streamed while the model writes them (:class:`CallScanner`)."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import orjson

from core.decoding.stop import StopMatcher

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
# a call's head as the model writes it (and the grammar holds it to): its name, then its arguments' start
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
HEAD_MAX = 320  # characters after the opening tag within which a streamable head must show


def call_id(prefix: str | None, index: int) -> str:
    """A turn's calls get ids from its prefix, so streamed calls and the parsed reply agree."""
    return f"call_{prefix}_{index}" if prefix else f"call_{uuid.uuid4().hex[:24]}"


def _call(obj: Any, names: set[str] | None, body: str = "", cid: str | None = None) -> dict[str, Any] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names is not None and obj["name"] not in names:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, str):  # as written when that is the same JSON: what a stream of it added up to
        raw = raw_arguments(body)
        args = raw if raw is not None and _same(raw, args) else orjson.dumps(args).decode()
    return {"id": cid or call_id(None, 0), "type": "function", "function": {"name": obj["name"], "arguments": args}}


def _same(raw: str, value: Any) -> bool:
    try:
        return bool(orjson.loads(raw) == value)
    except orjson.JSONDecodeError:
        return False


def json_end(text: str, start: int, state: list[Any] | None = None) -> int:
    """Where the JSON object or array that opens at ``start`` ends (the index after it), or -1
    if ``text`` ends first.  ``state`` ([depth, in_string, escaped]) carries a scan across calls."""
    depth, in_str, esc = state if state else (0, False, False)
    end = -1
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                end = i + 1
                break
    if state is not None:
        state[:] = [depth, in_str, esc]
    return end


def raw_arguments(body: str) -> str | None:
    """The arguments' JSON as written in a call's body, if it has the streamable form."""
    m = _HEAD.match(body)
    if m is None or body[m.end():m.end() + 1] not in ("{", "["):
        return None
    end = json_end(body, m.end())
    return body[m.end():end] if end > 0 else None


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


def parse(text: str, names: set[str] | None = None,
          prefix: str | None = None) -> tuple[str | None, list[dict[str, Any]]]:
    """Split model output into (content, OpenAI tool_calls); ``prefix``: the turn's id prefix.

    Qwen's format is ``<tool_call>{json}</tool_call>``; small models often answer
    with a bare (or fenced) JSON call instead, accepted when it names a known tool."""
    if OPEN in text:
        calls: list[dict[str, Any]] = []
        for body in _CALL.findall(text):
            if (c := _call(_loads(body), names, body, call_id(prefix, len(calls)))) is not None:
                calls.append(c)
        content = text[: text.index(OPEN)].strip() or None
        return (content, calls) if calls else (text, [])
    if names:
        doc = _loads(text)
        items = doc if isinstance(doc, list) else [doc]
        calls = []
        for item in items:
            if (c := _call(item, names, "", call_id(prefix, len(calls)))) is not None:
                calls.append(c)
        if calls and len(calls) == len(items):
            return None, calls
    return text, []


@dataclass(slots=True, frozen=True)
class CallStart:
    """A call the model has begun: its name is written, its arguments follow."""

    index: int
    id: str
    name: str


@dataclass(slots=True, frozen=True)
class CallArgs:
    """More of call ``index``'s arguments, as the model wrote them."""

    index: int
    fragment: str


Piece = str | CallStart | CallArgs


class CallScanner:
    """Streams the calls of a reply as they are written: a :class:`CallStart` once a call's
    head names an offered tool, then its arguments' JSON as :class:`CallArgs` fragments up to
    the closing brace.  A call in another form stops the scan; the parsed reply then carries
    it whole (the encoders send what the stream did not)."""

    def __init__(self, names: set[str] | None, prefix: str | None) -> None:
        self.names, self.prefix = names, prefix
        self.pos = 0  # how far into the call region the scan has read
        self.index = -1
        self.state = "seek"  # seek (the next head) | args | dead
        self._json: list[Any] = []

    def feed(self, region: str) -> list[Piece]:
        """``region``: the reply from its first ``<tool_call>`` on, as far as it is written."""
        out: list[Piece] = []
        while self.state == "seek" and (at := region.find(OPEN, self.pos)) >= 0:
            m = _HEAD.match(region, at + len(OPEN))
            if m is None or m.end() == len(region):  # not yet written, or not this form
                if len(region) - at > HEAD_MAX or CLOSE in region[at:]:
                    self.state = "dead"
                return out
            name = orjson.loads(f'"{m.group(1)}"')
            if region[m.end()] not in "{[" or (self.names is not None and name not in self.names):
                self.state = "dead"
                return out
            self.index += 1
            out.append(CallStart(self.index, call_id(self.prefix, self.index), name))
            self.pos, self.state, self._json = m.end(), "args", [0, False, False]
            out += self._args(region)
        if self.state == "args":
            out += self._args(region)
        return out

    def _args(self, region: str) -> list[Piece]:
        start = self.pos
        end = json_end(region, start, self._json)
        self.pos = end if end > 0 else len(region)
        if end > 0:
            self.state = "seek"
        return [CallArgs(self.index, region[start:self.pos])] if self.pos > start else []


class StreamFilter:
    """Streamed text of a reply to a request that offered tools.

    Text that may be a call is held back: everything from ``<tool_call>`` on, and a
    reply that opens like bare or fenced JSON.  Calls in the tagged form stream as
    :class:`CallStart` and :class:`CallArgs` pieces while they are written.  Once the
    whole reply is parsed, :meth:`release` gives the rest of its content, so the
    streamed text always adds up to the final message's content and a client never
    sees call syntax."""

    def __init__(self, names: set[str] | None = None, prefix: str | None = None) -> None:
        self._cut = StopMatcher((OPEN,))
        self._seen = ""  # everything fed past the cut
        self._shown = 0  # characters of it already passed on
        self._json_like: bool | None = None
        self._raw = ""  # everything fed
        self._calls = CallScanner(names, prefix)

    def feed(self, piece: str) -> list[Piece]:
        """What of ``piece`` is safe to show now: text, and the calls it writes."""
        self._raw += piece
        if self._cut.stopped:
            return self._scan()
        self._seen += self._cut.feed(piece)
        if self._json_like is None and self._seen.strip():
            self._json_like = self._seen.lstrip().startswith(("{", "[", "```"))
        out: list[Piece] = []
        if self._json_like is False and self._shown < len(self._seen):
            out.append(self._seen[self._shown:])
            self._shown = len(self._seen)
        return out + (self._scan() if self._cut.stopped else [])

    def _scan(self) -> list[Piece]:
        if self._json_like is not False and self._seen.strip():  # a JSON-like reply is parsed whole
            return []
        return self._calls.feed(self._raw[self._raw.find(OPEN):])

    def release(self, message: dict[str, Any]) -> str:
        """What is left to show of the final ``message``: nothing when it made calls."""
        content = message.get("content") or ""
        if message.get("tool_calls") or not content.startswith(self._seen[: self._shown]):
            return ""
        return content[self._shown:]


def unsent(arguments: str, sent: str) -> str:
    """What a stream that sent ``sent`` of a call's final ``arguments`` still owes."""
    return arguments[len(sent):] if arguments.startswith(sent) else ""


def names_of(tools: Any) -> set[str] | None:
    if not tools:
        return None
    return {t["function"]["name"] for t in tools if isinstance(t.get("function", {}).get("name"), str)}
