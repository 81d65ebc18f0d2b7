"""Idle work on the model thread, one bounded piece at a time, between turns.

In order: fill or complete a shared prefix's entry (one copy, and the tier then serves it
to other replicas); rewrite a held reply that called tools in the form the client resends
it; grow the buffers a session's next turn copies through; catch a scorer up; checkpoint a
session.  Before the process stops, :func:`settle` does what the tier is still owed.

**Held replies** (issue 41): after a turn the target holds the reply as it was generated.
The client resends it in its own form (a ``tool_use`` block, an OpenAI ``tool_calls``
entry), which the chat template renders otherwise: the arguments re-serialized, the
end-of-turn token, the results' opening.  While the client runs its tools, the held tail
is replaced by the template's form of the same reply, so the next turn's prefix match runs
through it.  A client that resends something else loses nothing but the rewrite.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from core.kv.positions import dense_prefix, speculator_backlog
from core.kv.stores import Holder
from core.runtime.residency import Residency
from core.spans import common_prefix

if TYPE_CHECKING:  # the engine runs on the model thread
    from core.engine import Engine

log = structlog.get_logger("specgate.sessions")


def run_one(res: Residency, engine: Engine, catch_up_tokens: int) -> bool:
    """One piece of idle work; False: none.  ``catch_up_tokens`` bounds one idle prefill
    (0: no idle prefills)."""
    if complete_prefix(res, engine):
        return True
    if catch_up_tokens > 0:
        rewritten = rewrite_held_reply(engine, res.idle_sessions(), catch_up_tokens)
        if rewritten is not None:
            res.rewritten += rewritten
            return True
    if any(engine.reserve_buffers(slot) for slot, _ in res.idle_sessions()):
        return True
    if catch_up_tokens > 0 and catch_up(res, engine, catch_up_tokens) > 0:
        return True
    return checkpoint(res, engine)


def catch_up(res: Residency, engine: Engine, max_tokens: int) -> int:
    """Bring the scorer's KV of the idle resident session furthest behind one chunk closer to
    its target's, so that its next turn scores only its new tokens
    (core.kv.positions.speculator_backlog).  Returns the tokens decoded; 0: nothing to do."""
    best: tuple[int, int, Holder] | None = None
    for slot, holder in res.idle_sessions():
        behind = len(speculator_backlog(holder.kv, engine.speculator_ctx.seq(slot).n_ctx - 1)[1])
        if behind and (best is None or behind > best[0]):
            best = (behind, slot, holder)
    if best is None:
        return 0
    _, slot, session = best
    done = engine.slot_cells.catch_up_speculator(session.kv, slot, max_tokens)
    res.caught_up += done
    return done


def complete_prefix(res: Residency, engine: Engine) -> bool:
    """Copy a wanted shared prefix's entry from an idle resident session of its owner that
    holds it (a sibling conversation adopted it from there, and left the copy for now, off
    its reply path); else give an entry kept without the speculator's part (copied from a
    session whose scorer the tool guard deferred) that part, from a session whose scorer
    has caught up past it.  Sessions started from the entry then hold the prefix in both
    models, so a later turn can score just its new tokens (issue 41)."""
    prefixes = res.prefixes
    for pending, with_scorer in ((prefixes.unfilled, False), (prefixes.lacking, True)):
        for key, (owner, tokens) in list(pending.items()):
            for slot, holder in res.idle_sessions():
                blobs = engine.slot_cells.cut_prefix(tokens, slot, holder.kv, with_scorer) \
                    if holder.owner == owner else None
                if blobs is None:
                    continue
                evicted = prefixes.complete(key, blobs) if with_scorer else prefixes.fill(key, owner, tokens, blobs)
                log.info("prefix_completed" if with_scorer else "prefix_cached", tokens=len(tokens),
                         copied_from=holder.id, with_scorer=bool(blobs[1]), evicted=len(evicted))
                return True
    return False


def checkpoint(res: Residency, engine: Engine) -> bool:
    """Save the KV of one idle resident session that has grown since its last checkpoint
    into the KV tier, so that a replica taking it over, or this one after a restart,
    restores it.  Only a session whose target holds all its tokens densely (no SpecPrefill
    gaps) is saved whole; its scorer's part goes along when it holds the same tokens.  One
    save is a copy of the session's KV: a turn that arrives waits for it (tens of ms per 1K
    tokens)."""
    if res.checkpoints is None:
        return False
    for slot, holder in res.idle_sessions():
        tokens = tuple(holder.kv.target.tokens)
        n = dense_prefix(holder.kv.target, tokens)
        if n != len(tokens) or not res.checkpoints.due(holder.key, n):
            continue
        with_scorer = dense_prefix(holder.kv.speculator, tokens) == n == len(holder.kv.speculator.tokens)
        if res.checkpoints.write(holder.key, holder.owner, tokens, engine.slot_cells.save(slot, with_scorer)):
            log.info("session_checkpointed", session_id=holder.id, tokens=n, with_scorer=with_scorer)
            return True
    return False


def settle(res: Residency, engine: Engine, deadline: float) -> tuple[int, int]:
    """Drain, before the process stops: what idle work still owes the tier -- the wanted
    prefix entries idle sessions hold, then a checkpoint of each idle session due one --
    done while ``deadline`` (``time.monotonic()``) allows.  Returns (entries queued for the
    tier, entries left for lack of time)."""
    done = 0
    while time.monotonic() < deadline and (complete_prefix(res, engine) or checkpoint(res, engine)):
        done += 1
    return done, _owed(res)


def _owed(res: Residency) -> int:
    idle = res.idle_sessions()
    # an entry lacking only the scorer's part is there: it is completed once a scorer catches up
    prefixes = sum(any(holder.owner == owner for _, holder in idle) for owner, _ in res.prefixes.unfilled.values())
    checkpoints = res.checkpoints
    due = sum(checkpoints.due(holder.key, n) and n == len(holder.kv.target.tokens)
              for _, holder in idle if (n := dense_prefix(holder.kv.target, holder.kv.target.tokens))) \
        if checkpoints is not None else 0
    return prefixes + due


def rewrite_held_reply(engine: Engine, idle: Sequence[tuple[int, Holder]], max_tokens: int) -> int | None:
    """Rewrite the held reply of one idle resident session that is waiting for tool results
    (one decode of at most ``max_tokens``); returns the tokens prefilled, None when no
    rewrite was due."""
    for slot, session in idle:
        tools, session.resend_tools = session.resend_tools, None
        if tools is None or not session.messages:
            continue
        form = engine.chat.resend_form(session.messages, tools or None)
        held = session.kv.target.tokens
        if common_prefix(form, held) < min(session.last_prompt_n, len(held)):
            continue  # the history renders otherwise than the turn's prompt did: leave it
        n = engine.slot_cells.rewrite_tail(session.kv, slot, form, max_tokens)
        log.info("held_reply_rewritten", session_id=session.id, prefilled=n, tokens=len(form))
        return n
    return None
