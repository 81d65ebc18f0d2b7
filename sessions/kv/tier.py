"""A KV tier that outlives the process: shared prefixes' KV (and session checkpoints,
sessions.kv.checkpoints) kept where a restarted server, or another replica, restores it
instead of prefilling it again.  On a CPU, reading a prefix's KV (about 40 KiB a token for
the Qwen pair in f16) takes a fraction of a second; prefilling a 14K-token prompt took
minutes.

An entry is named by a hash of its key (the owner and the exact tokens: one key never finds
another's) and framed like a spill file (sessions.kv.parked: magic, the model pair's
fingerprint, lengths, checksum); an entry that fails a check is deleted and recomputed, never
loaded.  Writes run on a thread of their own, off the model thread, and the tier is kept
within a byte budget, least recently used first (a read refreshes an entry).  Small
"notes" (a session checkpoint's index) live beside the entries.

Two backends, chosen by ``--kv-tier-dir``: a folder (:class:`DirectoryTier`, the default;
a shared mount serves every replica), or a Redis URL (sessions.kv.tier_redis.RedisTier, for
deployments with Redis and no shared disk).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import os
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog

from sessions.kv.parked import Blobs, frame, unframe

log = structlog.get_logger("specgate.sessions")


class KVTier(abc.ABC):
    """What both backends share: naming, framing and checks, the writer thread, counters."""

    where = ""  # for logs: the folder or the Redis URL (without its password)

    def __init__(self, fingerprint: bytes, budget_bytes: int) -> None:
        self.fingerprint = hashlib.sha256(fingerprint).digest()
        self.budget = budget_bytes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="specgate-kv-tier")
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self.hits = self.misses = self.writes = self.rejected = self.write_failures = 0

    @staticmethod
    def name(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:40]

    # -- what a backend provides -------------------------------------------------
    @abc.abstractmethod
    def _read(self, name: str) -> bytes | None: ...

    @abc.abstractmethod
    def _store(self, name: str, data: bytes) -> None:
        """Store an entry whole or not at all (raises on failure)."""

    @abc.abstractmethod
    def _delete(self, name: str) -> None: ...

    @abc.abstractmethod
    def _exists(self, name: str) -> bool: ...

    @abc.abstractmethod
    def _touch(self, name: str) -> None:
        """Recently used: the last to go."""

    @abc.abstractmethod
    def _make_room(self, incoming: int) -> None: ...

    @abc.abstractmethod
    def read_note(self, name: str) -> bytes | None: ...

    @abc.abstractmethod
    def write_note(self, name: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def delete_note(self, name: str) -> None: ...

    @property
    @abc.abstractmethod
    def bytes_used(self) -> int: ...

    # -- the tier ------------------------------------------------------------------
    def has(self, key: str) -> bool:
        return self._exists(self.name(key))

    def drop(self, key: str) -> None:
        self._delete(self.name(key))

    def get(self, key: str) -> Blobs | None:
        """The entry's blobs, or None (absent, being written, or failing a check: then deleted)."""
        name = self.name(key)
        data = self._read(name)
        if data is None:
            self.misses += 1
            return None
        try:
            blobs = unframe(data, self.fingerprint)
        except ValueError as exc:
            self.rejected += 1
            log.warning("kv_tier_rejected", entry=name, error=str(exc))
            self._delete(name)
            return None
        self._touch(name)
        self.hits += 1
        return blobs

    def put(self, key: str, blobs: Blobs, then: Callable[[], None] | None = None, replace: bool = False) -> None:
        """Write the entry in the background (an entry already there, or being written, stays
        unless ``replace``); ``then`` runs on the writer once the entry is there (not when its
        write failed)."""
        with self._lock:
            if not replace and (key in self._pending or self.has(key)):
                if then is not None:  # one writer thread: after the write under way, if any
                    self._writer.submit(lambda: self.has(key) and then())
                return
            self._pending.add(key)
        self._writer.submit(self._write, key, blobs, then)

    def _write(self, key: str, blobs: Blobs, then: Callable[[], None] | None = None) -> None:
        name, data = self.name(key), frame(blobs, self.fingerprint)
        try:
            if len(data) > self.budget:
                return
            self._make_room(len(data))
            self._store(name, data)
            self.writes += 1
            if then is not None:
                then()
        except Exception as exc:  # noqa: BLE001 -- a failed write costs a recompute, never a turn
            self.write_failures += 1
            log.warning("kv_tier_write_failed", entry=name, bytes=len(data), error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._pending.discard(key)

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the writes under way (a restart then finds them)."""
        self._writer.shutdown(wait=True)


class DirectoryTier(KVTier):
    """Entries as files in ``<root>/prefixes`` (written through a temporary file, fsync and a
    rename: replicas on one shared folder may write at once), notes in ``<root>/notes``."""

    def __init__(self, root: str | Path, fingerprint: bytes, budget_bytes: int) -> None:
        super().__init__(fingerprint, budget_bytes)
        self.dir = Path(root).expanduser() / "prefixes"
        self.notes = self.dir.parent / "notes"
        for d in (self.dir, self.notes):
            d.mkdir(parents=True, exist_ok=True)
        self.where = str(self.dir.parent)

    def path(self, key: str) -> Path:
        return self._file(self.name(key))

    def _file(self, name: str) -> Path:
        return self.dir / f"{name}.kv"

    def _read(self, name: str) -> bytes | None:
        try:
            return self._file(name).read_bytes()
        except OSError:
            return None

    def _store(self, name: str, data: bytes) -> None:
        _atomic_write(self._file(name), data, sync=True)

    def _delete(self, name: str) -> None:
        self._file(name).unlink(missing_ok=True)

    def _exists(self, name: str) -> bool:
        return self._file(name).exists()

    def _touch(self, name: str) -> None:
        with contextlib.suppress(OSError):
            os.utime(self._file(name))

    def _make_room(self, incoming: int) -> None:
        files = []
        for p in self.dir.glob("*.kv"):
            with contextlib.suppress(OSError):
                st = p.stat()
                files.append((st.st_mtime, st.st_size, p))
        used = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if used + incoming <= self.budget:
                break
            p.unlink(missing_ok=True)
            used -= size
            log.info("kv_tier_dropped", file=p.name, reason="tier budget")

    def read_note(self, name: str) -> bytes | None:
        try:
            return (self.notes / name).read_bytes()
        except OSError:
            return None

    def write_note(self, name: str, data: bytes) -> None:
        _atomic_write(self.notes / name, data, sync=False)

    def delete_note(self, name: str) -> None:
        (self.notes / name).unlink(missing_ok=True)

    @property
    def bytes_used(self) -> int:
        total = 0
        for p in self.dir.glob("*.kv"):
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total


def _atomic_write(path: Path, data: bytes, sync: bool) -> None:
    tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.partial")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
