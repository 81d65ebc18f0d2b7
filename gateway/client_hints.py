"""What agent clients send besides the conversation: session ids that group their requests,
and lines that change per conversation at the head of an otherwise stable prompt.

SpecGate's own exclusive session is named by :data:`SESSION_HEADER` (``X-SpecGate-Session``),
a name no client uses for anything else.  The ids real clients send on their own --
Claude Code's ``X-Claude-Code-Session-Id``, Codex's ``session-id``/``thread-id`` (and its
body's ``prompt_cache_key``), opencode's ``x-session-id``/``x-session-affinity`` -- are
*hints*: they narrow which held conversation a request continues, and never lock one, so two
requests with one id (opencode's title request beside its turn) fork instead of getting a 409.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import orjson

SESSION_HEADER = "X-SpecGate-Session"  # names an exclusive session (409 while it runs a turn)
IMPLICIT_HEADER = "X-SpecGate-Session-Implicit"  # on a response: the session was found by its tokens
# clients' own grouping ids, most specific first
HINT_HEADERS = ("X-Claude-Code-Session-Id", "session-id", "thread-id", "x-session-affinity", "x-session-id")
MAX_HINT = 256
# Claude Code's first system block: ``x-anthropic-billing-header: cc_version=2.1.328.b5e; cc_entrypoint=sdk-cli;``
# (earlier 2.1.x added a per-request ``cch=<nonce>;``); it differs between conversations and sits before
# ~14K tokens of system prompt and tools that do not
BILLING_LINE = re.compile(r"\Ax-anthropic-billing-header:[^\n]*(?:\n|\Z)")


def header_hint(headers: Mapping[str, str]) -> str | None:
    """The first client session id among :data:`HINT_HEADERS`."""
    for name in HINT_HEADERS:
        if value := headers.get(name):
            return bounded(value)
    return None


def bounded(value: str) -> str:
    """A hint as kept: long ones by their digest (a hint only groups; it is never refused)."""
    if len(value) <= MAX_HINT:
        return value
    return "sha256:" + hashlib.sha256(value.encode()).hexdigest()


def anthropic_user_hint(user_id: Any) -> str | None:
    """``metadata.user_id``: Claude Code sends a JSON string holding its ``session_id``
    (and a device id shared by all its conversations); others send a plain id."""
    if not isinstance(user_id, str) or not user_id:
        return None
    if user_id.startswith("{"):
        try:
            doc = orjson.loads(user_id)
        except orjson.JSONDecodeError:
            doc = None
        if isinstance(doc, dict) and isinstance(doc.get("session_id"), str) and doc["session_id"]:
            return bounded(doc["session_id"])
    return bounded(user_id)


def strip_billing_line(text: str) -> tuple[str, bool]:
    """``text`` without a leading billing line, and whether one was there."""
    stripped = BILLING_LINE.sub("", text, count=1)
    return stripped, stripped != text
