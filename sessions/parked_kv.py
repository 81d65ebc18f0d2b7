"""Parked session KV: both models' serialized sequences of the sessions that are not
resident, under a RAM byte budget.

Least recently used sessions are evicted past the budget: spilled to disk when
a spill directory is configured, dropped otherwise.  A dropped session simply
rebuilds its caches on its next turn.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from pathlib import Path

Blobs = tuple[bytes, bytes]  # (target, speculator)


def _size(blobs: Blobs) -> int:
    return len(blobs[0]) + len(blobs[1])


class ParkedKV:
    def __init__(self, budget_bytes: int, spill_dir: str | None = None) -> None:
        self.budget = budget_bytes
        self.spill_dir = Path(spill_dir) if spill_dir else None
        if self.spill_dir:
            self.spill_dir.mkdir(parents=True, exist_ok=True)
        self._ram: OrderedDict[str, Blobs] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes_in_ram = 0
        self.evictions = 0

    def _spill_path(self, session_id: str) -> Path | None:
        return self.spill_dir / f"{session_id}.kv" if self.spill_dir else None

    def put(self, session_id: str, blobs: Blobs) -> list[str]:
        """Store a session's KV; returns the sessions evicted from RAM to make room."""
        with self._lock:
            self._pop(session_id)
            self._ram[session_id] = blobs
            self.bytes_in_ram += _size(blobs)
            evicted = []
            while self.bytes_in_ram > self.budget and len(self._ram) > 0:
                victim, victim_blobs = self._ram.popitem(last=False)
                self.bytes_in_ram -= _size(victim_blobs)
                self._spill(victim, victim_blobs)
                evicted.append(victim)
            self.evictions += len(evicted)
            return evicted

    def take(self, session_id: str) -> Blobs | None:
        """Remove and return a session's KV from RAM or disk; None if it was dropped."""
        with self._lock:
            blobs = self._pop(session_id)
        if blobs is not None:
            return blobs
        path = self._spill_path(session_id)
        if path is None or not path.exists():
            return None
        data = path.read_bytes()
        path.unlink()
        split = int.from_bytes(data[:8], "little")
        return data[8: 8 + split], data[8 + split:]

    def discard(self, session_id: str) -> None:
        with self._lock:
            self._pop(session_id)
        path = self._spill_path(session_id)
        if path is not None:
            path.unlink(missing_ok=True)

    def where(self, session_id: str) -> str:
        if session_id in self._ram:
            return "ram"
        path = self._spill_path(session_id)
        return "disk" if path is not None and path.exists() else "none"

    def _pop(self, session_id: str) -> Blobs | None:
        blobs = self._ram.pop(session_id, None)
        if blobs is not None:
            self.bytes_in_ram -= _size(blobs)
        return blobs

    def _spill(self, session_id: str, blobs: Blobs) -> None:
        path = self._spill_path(session_id)
        if path is not None:
            tmp = path.with_suffix(".partial")
            tmp.write_bytes(len(blobs[0]).to_bytes(8, "little") + blobs[0] + blobs[1])
            tmp.replace(path)
