"""Which session each slot of the model contexts holds (model thread only).

A slot is one sequence id in both contexts.  A running turn keeps its slot
busy; between turns a session stays resident in its slot until another turn
needs the room, and the least recently used idle slot gives way (its KV is
parked by the caller).  Holders are objects, not names: a session deleted and
created again under the same id is a different holder, and never sees the old
KV.
"""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import EngineError


@dataclass(slots=True)
class Seat:
    slot: int
    fresh: bool  # the holder was not resident: its KV must be restored or rebuilt
    displaced: object | None  # the idle holder that gave the slot up (park its KV first)


class SlotTable:
    def __init__(self, n: int) -> None:
        self._holder: list[object | None] = [None] * n
        self._busy = [False] * n
        self._used = [0] * n  # when each slot was last released (LRU among idle ones)
        self._gen = [0] * n  # bumped whenever a slot is seated, released or emptied (see stamp)
        self._clock = 0

    def __len__(self) -> int:
        return len(self._holder)

    @property
    def busy(self) -> int:
        return sum(self._busy)

    @property
    def resident(self) -> int:
        return sum(h is not None for h in self._holder)

    def idle(self) -> list[tuple[int, object]]:
        """(slot, holder) of every resident holder whose slot has no turn running."""
        return [(i, h) for i, h in enumerate(self._holder) if h is not None and not self._busy[i]]

    def find(self, holder: object) -> int | None:
        for i, h in enumerate(self._holder):
            if h is holder:
                return i
        return None

    def stamp(self, slot: int) -> tuple[object | None, int]:
        """Who holds ``slot``, and its generation.  A turn that reads another slot's KV after
        a step (a splice after the prefill of its gap) compares stamps first: between steps
        other turns run, and the slot may have been seated, emptied or given to another key."""
        return self._holder[slot], self._gen[slot]

    def unchanged(self, slot: int, stamp: tuple[object | None, int]) -> bool:
        return self._holder[slot] is stamp[0] and self._gen[slot] == stamp[1]

    def seat(self, holder: object) -> Seat:
        """A slot for ``holder``'s turn: its own, else a free one, else the least recently
        used idle one.  Every slot busy is a bug in admission (at most one turn per slot)."""
        if (mine := self.find(holder)) is not None:
            if self._busy[mine]:
                raise EngineError("a holder's slot is already busy")
            self._busy[mine] = True
            self._gen[mine] += 1
            return Seat(mine, False, None)
        idle = [i for i in range(len(self)) if not self._busy[i]]
        if not idle:
            raise EngineError(f"all {len(self)} slots are busy")
        slot = min(idle, key=lambda i: (self._holder[i] is not None, self._used[i]))
        displaced, self._holder[slot] = self._holder[slot], holder
        self._busy[slot] = True
        self._gen[slot] += 1
        return Seat(slot, True, displaced)

    def release(self, slot: int, keep: bool = True) -> None:
        """The turn in ``slot`` ended; ``keep=False`` also forgets its holder (the KV is gone)."""
        self._busy[slot] = False
        self._gen[slot] += 1
        self._clock += 1
        self._used[slot] = self._clock
        if not keep:
            self._holder[slot] = None

    def evict(self, holder: object) -> int | None:
        """Forget an idle ``holder`` (deleted, expired, moved away); returns its slot."""
        slot = self.find(holder)
        if slot is not None and not self._busy[slot]:
            self._holder[slot] = None
            self._gen[slot] += 1
            return slot
        return None
