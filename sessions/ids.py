"""Session ids and the keys that namespace them by owner (no llama.cpp needed)."""

from __future__ import annotations

import re
from typing import Any

from core.errors import InvalidRequest

SESSION_ID = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check_id(session_id: Any) -> str:
    """Client-chosen ids are 1-64 ASCII letters, digits, '-' and '_' (no path can hide in one)."""
    if not isinstance(session_id, str) or not SESSION_ID.fullmatch(session_id):
        raise InvalidRequest("a session id must be 1-64 ASCII letters, digits, '-' or '_'")
    return session_id


def session_key(owner: str, session_id: str) -> str:
    """Where a session lives in every table: another owner's id can never collide with it."""
    return f"{owner}:{session_id}"
