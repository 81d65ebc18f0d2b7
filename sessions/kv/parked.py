"""Parked session KV: both models' serialized sequences of the sessions that are not
resident, under a RAM byte budget.

Least recently used sessions are evicted past the budget: spilled to disk when
a spill directory is configured (itself capped in bytes), dropped otherwise.
A dropped session simply rebuilds its caches on its next turn.

A spill file is named by a hash of the session key (no client text reaches the
file system) and framed by a header -- magic, version, the model pair's
fingerprint, both blobs' lengths and a checksum -- written to a temporary
file, fsynced and renamed.  A file that fails any check is discarded and
counted, and its session rebuilds; a spill that cannot be written is counted
and dropped, never raised into another session's turn.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import struct
import threading
from collections import OrderedDict
from pathlib import Path

import structlog

from core.kv.stores import Blobs
from sessions.kv.private_files import private_dir, read_private, write_private

log = structlog.get_logger("specgate.sessions")
MAGIC = b"SGKV"
VERSION = 2  # 2: the checksum is keyed (a file written without the key fails it)
HEADER = struct.Struct("<4sH32sQQ16s")  # magic, version, fingerprint, target len, speculator len, checksum


def _size(blobs: Blobs) -> int:
    return len(blobs[0]) + len(blobs[1])


def _checksum(blobs: Blobs, key: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16, key=key)
    h.update(blobs[0])
    h.update(blobs[1])
    return h.digest()


def frame(blobs: Blobs, fingerprint: bytes, key: bytes = b"") -> bytes:
    """``key`` (up to 64 bytes) keys the checksum: only a writer that holds it frames a file
    that :func:`unframe` accepts."""
    return HEADER.pack(MAGIC, VERSION, fingerprint, len(blobs[0]), len(blobs[1]), _checksum(blobs, key)) + \
        blobs[0] + blobs[1]


def unframe(data: bytes, fingerprint: bytes, key: bytes = b"") -> Blobs:
    """The blobs of a framed file; ValueError naming the first check that fails."""
    if len(data) < HEADER.size:
        raise ValueError(f"truncated header ({len(data)} bytes)")
    magic, version, fp, n_target, n_spec = HEADER.unpack_from(data)[:5]
    if magic != MAGIC or version != VERSION:
        raise ValueError(f"not a version-{VERSION} SpecGate KV file")
    if fp != fingerprint:
        raise ValueError("written for another model pair")
    if len(data) != HEADER.size + n_target + n_spec:
        raise ValueError(f"length {len(data)} != header's {HEADER.size + n_target + n_spec}")
    blobs = (data[HEADER.size:HEADER.size + n_target], data[HEADER.size + n_target:])
    if not hmac.compare_digest(_checksum(blobs, key), HEADER.unpack_from(data)[5]):
        raise ValueError("checksum mismatch (corrupt, or written without this deployment's key)")
    return blobs


class ParkedKV:
    def __init__(self, budget_bytes: int, spill_dir: str | None = None, fingerprint: bytes = b"\0" * 32,
                 spill_budget_bytes: int = 8 << 30, namespace: str = "") -> None:
        """``namespace`` (the replica's id): spill files go in a folder of its own under
        ``spill_dir``, so replicas that share one never remove each other's files."""
        self.budget = budget_bytes
        self.spill_budget = spill_budget_bytes
        self.spill_dir = None
        if spill_dir:
            own = re.sub(r"[^A-Za-z0-9._-]", "_", namespace)
            self.spill_dir = Path(spill_dir) / own if own.strip(".") else Path(spill_dir)
        self.fingerprint = hashlib.sha256(fingerprint).digest()
        self._key = os.urandom(32)  # spill files are this process's alone: nobody else can frame one
        self._ram: OrderedDict[str, Blobs] = OrderedDict()
        self._disk: OrderedDict[str, int] = OrderedDict()  # key -> file bytes, oldest first
        self._no_spill: set[str] = set()
        self._lock = threading.Lock()
        self.bytes_in_ram = 0
        self.evictions = 0
        self.spill_writes = 0
        self.spill_failures = 0
        self.spill_rejected = 0
        if self.spill_dir:
            private_dir(self.spill_dir)
            self._clear_stale(self.spill_dir)

    @property
    def bytes_on_disk(self) -> int:
        with self._lock:  # the metrics thread reads it while the model thread spills
            return sum(self._disk.values())

    @staticmethod
    def _clear_stale(spill_dir: Path) -> None:
        """Spill files of this replica's earlier process (its own folder only): their sessions'
        token bookkeeping is gone."""
        stale = [*spill_dir.glob("*.kv"), *spill_dir.glob("*.partial")]
        for path in stale:
            path.unlink(missing_ok=True)
        if stale:
            log.info("spill_stale_removed", files=len(stale))

    def _spill_path(self, key: str) -> Path | None:
        if self.spill_dir is None:
            return None
        return self.spill_dir / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv"

    def put(self, key: str, blobs: Blobs, spill: bool = True) -> list[str]:
        """Store a session's KV; returns the keys evicted from RAM to make room.  ``spill=False``:
        dropped, never spilled, when evicted (KV that is cheaper to build again than to keep)."""
        with self._lock:
            self._pop(key)
            self._ram[key] = blobs
            if not spill:
                self._no_spill.add(key)
            self.bytes_in_ram += _size(blobs)
            victims = []
            while self.bytes_in_ram > self.budget and self._ram:
                victim, victim_blobs = self._ram.popitem(last=False)
                self.bytes_in_ram -= _size(victim_blobs)
                victims.append((victim, victim_blobs))
            self.evictions += len(victims)
            spills = [(v, b) for v, b in victims if v not in self._no_spill]
            self._no_spill.difference_update(v for v, _ in victims)
        for victim, victim_blobs in spills:
            self._spill(victim, victim_blobs)
        return [v for v, _ in victims]

    def take(self, key: str) -> Blobs | None:
        """Remove and return a session's KV from RAM or disk; None if it was dropped or its
        file failed a check (the session then rebuilds)."""
        with self._lock:
            blobs = self._pop(key)
            on_disk = self._disk.pop(key, None) is not None
        if blobs is not None or not on_disk:
            return blobs
        path = self._spill_path(key)
        if path is None:
            return None
        try:
            data = read_private(path, self.spill_budget)
            if data is None:
                raise ValueError("the spill file is gone")
            return unframe(data, self.fingerprint, self._key)
        except (OSError, ValueError) as exc:
            self.spill_rejected += 1
            log.warning("spill_rejected", key_hash=path.stem, error=str(exc))
            return None
        finally:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)

    def peek(self, key: str) -> Blobs | None:
        """A key's KV if it is in RAM, left there as the most recently used."""
        with self._lock:
            blobs = self._ram.get(key)
            if blobs is not None:
                self._ram.move_to_end(key)
            return blobs

    def discard(self, key: str) -> None:
        with self._lock:
            self._pop(key)
            self._disk.pop(key, None)
        path = self._spill_path(key)
        if path is not None:
            path.unlink(missing_ok=True)

    def where(self, key: str) -> str:
        if key in self._ram:
            return "ram"
        return "disk" if key in self._disk else "none"

    def _pop(self, key: str) -> Blobs | None:
        self._no_spill.discard(key)
        blobs = self._ram.pop(key, None)
        if blobs is not None:
            self.bytes_in_ram -= _size(blobs)
        return blobs

    def _spill(self, key: str, blobs: Blobs) -> None:
        path = self._spill_path(key)
        if path is None:
            return
        data = frame(blobs, self.fingerprint, self._key)
        if len(data) > self.spill_budget:
            return
        self._make_room(len(data))
        try:
            write_private(path, data, sync=True)
        except OSError as exc:
            self.spill_failures += 1
            log.warning("spill_failed", key_hash=path.stem, bytes=len(data), error=str(exc))
            return
        self.spill_writes += 1
        with self._lock:
            self._disk[key] = len(data)

    def _make_room(self, n: int) -> None:
        while self._disk and self.bytes_on_disk + n > self.spill_budget:
            with self._lock:
                oldest, _ = self._disk.popitem(last=False)
            path = self._spill_path(oldest)
            if path is not None:
                path.unlink(missing_ok=True)
            log.info("spill_dropped", reason="spill budget")
