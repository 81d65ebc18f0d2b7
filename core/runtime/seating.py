"""A turn's opening and closing steps on the model thread: seat it in a slot, start its KV
(kept, parked, rebuilt from a checkpoint, or from a shared prefix), run the engine's turn,
and give the slot up.  A failed turn never leaves bookkeeping that disagrees with the
cells: the session's KV is reset and rebuilt by its next turn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from core.errors import TurnCancelled
from core.kv.positions import SessionKV
from core.kv.stores import Holder
from core.prompt import Prompt
from core.results import PrefixStart, Result
from core.runtime import prefix_starts
from core.runtime.residency import Residency
from core.steps import TurnSteps
from core.turn_request import TurnRequest

if TYPE_CHECKING:  # the engine runs on the model thread
    from core.engine import Engine

log = structlog.get_logger("specgate.sessions")


@dataclass(slots=True)
class TurnOutcome:
    result: Result
    evicted: list[str]  # keys of sessions whose parked KV was evicted to make room for this turn


def checked(engine: Engine, work: TurnRequest) -> Prompt:
    """The turn's prompt, checked against the context once: when it was rendered on the
    request's way in (``work.checked``), or here, before any slot is touched."""
    prompt = work.render(engine)
    if not work.checked:
        engine.check_turn(prompt, work.params)
    return prompt


def stateless(res: Residency, engine: Engine, work: TurnRequest) -> TurnSteps[TurnOutcome]:
    """A turn with no session: a slot for its length, from a shared prefix, emptied after."""
    if work.cancel.is_set():
        raise TurnCancelled("the client left before the turn started")
    prompt = checked(engine, work)  # before another session's KV is disturbed
    seat = res.slots.seat(object())
    evicted = res.park(engine, seat)
    kv, start = SessionKV(), PrefixStart()
    try:
        engine.slot_cells.load(None, seat.slot)
        start = yield from prefix_starts.from_prefix(res, engine, work.owner, kv, prompt, seat.slot)
        evicted += start.evicted
        result = yield from engine.turn(prompt, work.params, work.sink, kv=kv, slot=seat.slot, checked=True,
                                        start=start)
    finally:
        res.slots.release(seat.slot, keep=False)
    return TurnOutcome(result, evicted)


def session_turn(res: Residency, engine: Engine, session: Holder, work: TurnRequest) -> TurnSteps[TurnOutcome]:
    """A session's turn: its own slot if it is resident, else a free or the least recently
    used idle one (that session's KV parked first) with its KV restored or started."""
    if work.cancel.is_set():
        raise TurnCancelled("the turn was cancelled before it started")
    prompt = checked(engine, work)  # a bad request must not cost the session its cache
    seat = res.slots.seat(session)
    evicted = res.park(engine, seat)
    rebuilt, start = False, PrefixStart()
    try:
        if seat.fresh:
            blobs = res.parked.take(session.key)
            if blobs is None and session.turns:
                # dropped under the budget, failed its checks, or hydrated from the store: rebuild
                session.kv.reset()
                session.rebuilds += 1
                rebuilt = True
                log.info("session_kv_rebuild", session_id=session.id)
            engine.slot_cells.load(blobs, seat.slot)
            if blobs is None and rebuilt:
                start = prefix_starts.from_checkpoint(res, engine, session, prompt, seat.slot)
            if blobs is None and not start.shared:
                start = yield from prefix_starts.from_prefix(res, engine, session.owner, session.kv, prompt,
                                                             seat.slot)
                evicted += start.evicted
        start.rebuilt = rebuilt
        result = yield from engine.turn(prompt, work.params, work.sink, kv=session.kv, slot=seat.slot,
                                       checked=True, start=start)
    except BaseException:
        session.kv.reset()
        engine.slot_cells.load(None, seat.slot)
        raise
    finally:
        res.slots.release(seat.slot, keep=not session.deleted)
    return TurnOutcome(result, evicted)
