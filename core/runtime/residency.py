"""Where sessions' KV lives: the slots of the two model contexts and the stores behind them.

Both models' contexts hold up to ``slots`` sessions' KV at once (:class:`SlotTable`), and
their turns run together in the step loop.  A turn for a session that is not resident takes
a free slot or the least recently used idle one, whose KV is saved into the parked store
(RAM under a budget, LRU, optional disk spill); a session whose KV was dropped rebuilds it
from its tokens on its next turn.  The residency is model-thread state: seating
(core.runtime.seating), the prefix starts (core.runtime.prefix_starts) and idle work
(core.runtime.idle_work) read and change it there; the event loop reads its counters and
the slot table's levels as snapshots.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import structlog

from core.kv.slot_table import Seat, SlotTable
from core.kv.stores import CheckpointStore, Holder, ParkedStore, PrefixStore

if TYPE_CHECKING:  # the engine runs on the model thread
    from core.engine import Engine

log = structlog.get_logger("specgate.sessions")


class Residency:
    def __init__(self, slots: int, parked: ParkedStore, prefixes: PrefixStore,
                 checkpoints: CheckpointStore | None = None, splice_min_tokens: int = 0,
                 isolate: bool = False) -> None:
        """``splice_min_tokens``: the shortest run past the shared prefix worth moving in from a
        sibling (0: none).  ``isolate``: conversations of one key share no more than the system
        prompt and tools (``--isolate-conversations``: many end users behind one key)."""
        self.slots = SlotTable(slots)
        self.parked = parked
        self.prefixes = prefixes
        self.checkpoints = checkpoints
        self.splice_min_tokens = 0 if isolate else splice_min_tokens
        self.isolate = isolate
        self.spliced = 0  # tokens moved into place from another conversation's KV, not prefilled
        self.splices_skipped = 0  # splices given up: the donor's slot changed while their gap was prefilled
        self.caught_up = 0  # scorer tokens prefilled in idle time
        self.rewritten = 0  # target tokens prefilled in idle time by held replies rewritten

    def idle_sessions(self) -> list[tuple[int, Holder]]:
        """(slot, session) of the resident sessions no turn is using: what idle work may touch."""
        return [(slot, holder) for slot, holder in self.slots.idle() if isinstance(holder, Holder) and holder.idle]

    def park(self, engine: Engine, seat: Seat) -> list[str]:
        """Save the KV of the idle session ``seat`` displaced; returns the keys whose parked KV
        was evicted to make room."""
        victim = seat.displaced
        if not isinstance(victim, Holder) or victim.deleted or victim.dropped:
            return []  # deleted, expired or moved away: nothing to keep
        evicted = self.parked.put(victim.key, engine.slot_cells.save(seat.slot))  # deleted meanwhile: its drop follows
        for key in evicted:
            log.info("session_kv_evicted", session_key=key, spilled=self.parked.where(key) == "disk")
        return evicted

    def forget(self, engine: Engine, session: Holder) -> None:
        """A session's KV goes, resident or parked; a running turn keeps its slot until it
        ends and then gives it up (core.runtime.seating).  A deleted session's checkpoint
        goes too."""
        if (slot := self.slots.evict(session)) is not None:
            engine.slot_cells.load(None, slot)
        self.parked.discard(session.key)
        if self.checkpoints is not None and session.deleted:
            self.checkpoints.forget(session.key, session.owner)
