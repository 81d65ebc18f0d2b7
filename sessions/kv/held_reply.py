"""A held reply that called tools, rewritten in the form the client resends it (issue 41).

After a turn the target holds the reply as it was generated.  The client resends it in
its own form (a ``tool_use`` block, an OpenAI ``tool_calls`` entry) with the results,
and the chat template renders that differently from what was sampled: the arguments
re-serialized, the end-of-turn token, the results' opening.  So every tool turn used to
prefill those tokens again, deep in the context.  In idle time, while the client runs
its tools, the held tail is replaced by the template's form of the same reply, so the
next turn's prefix match runs through it.  A client that resends something else loses
nothing but the rewrite: the next turn reuses what still matches, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from core.spans import common_prefix
from sessions.session import Session

if TYPE_CHECKING:  # the engine runs on the model thread; this module only hands it work
    from core.engine import Engine

log = structlog.get_logger("specgate.sessions")


def rewrite_one(engine: Engine, idle: Sequence[tuple[int, Session]], max_tokens: int) -> int | None:
    """Rewrite the held reply of one idle resident session that is waiting for tool results
    (model thread, idle time: one decode of at most ``max_tokens``); returns the tokens
    prefilled, None when no rewrite was due."""
    for slot, session in idle:
        tools, session.resend_tools = session.resend_tools, None
        if tools is None or not session.messages:
            continue
        form = engine.chat.resend_form(session.messages, tools or None)
        held = session.kv.target.tokens
        if common_prefix(form, held) < min(session.last_prompt_n, len(held)):
            continue  # the history renders otherwise than the turn's prompt did: leave it
        n = engine.slot_kv.rewrite_tail(session.kv, slot, form, max_tokens)
        log.info("held_reply_rewritten", session_id=session.id, prefilled=n, tokens=len(form))
        return n
    return None
