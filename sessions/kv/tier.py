"""A KV tier that outlives the process: shared prefixes' KV (and session checkpoints,
sessions.kv.checkpoints) kept where a restarted server, or another replica, restores it
instead of prefilling it again.  On a CPU, reading a prefix's KV (about 40 KiB a token for
the Qwen pair in f16) takes a fraction of a second; prefilling a 14K-token prompt took
minutes.

An entry is named by a hash of its key (the owner and the exact tokens: one key never finds
another's) and framed like a spill file (sessions.kv.parked: magic, the layout's
fingerprint, lengths, a checksum keyed with the deployment's secret, sessions.kv.tier_secret);
an entry that fails a check is deleted, counted and recomputed, never loaded.  Small "notes"
(a checkpoint's index) carry the same keyed tag.  Entries and notes live under the
fingerprint's own name, so replicas with other models or KV settings never read, evict or
delete them.

Nothing here blocks the threads that serve: writes run on the tier's writer thread, from a
queue bounded in bytes (a checkpoint that does not fit is skipped and counted); the model
thread's lookups (:meth:`KVTier.has`, :meth:`KVTier.get`, :meth:`KVTier.note`) run on reader
threads under a deadline, and a lookup past it is a miss (the turn builds its prefix) and
leaves the tier alone for a while; the byte count ``/metrics`` shows is kept as writes land.
The tier stays within a byte budget, least recently used first.

Two backends, chosen by ``--kv-tier-dir``: a folder (:class:`DirectoryTier`; a shared mount
serves every replica), or a Redis URL (sessions.kv.tier_redis.RedisTier).
"""

from __future__ import annotations

import abc
import concurrent.futures
import contextlib
import hashlib
import hmac
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog

from sessions.kv.parked import Blobs, frame, unframe
from sessions.kv.private_files import Refused, private_dir, read_private, remove_partials, write_private

log = structlog.get_logger("specgate.sessions")
T = TypeVar("T")
TAG = 16  # bytes of keyed tag before a note's data
NOTE_MAX = 32 << 20  # a note lists tokens: an owner's 8 newest checkpoints of 100K tokens are ~6 MB
PARTIAL_AGE_S = 600.0  # a temporary file this old is a killed writer's, not a replica's write under way
BACKOFF_S = 30.0  # after a lookup past its deadline, lookups miss at once for this long
# An entry's read gets this rate's time on top of the lookup deadline: the slowest transfer
# still worth waiting for.  A 1.5B target's KV with its scorer's is ~40 KB a token, so 16 MB/s
# brings back ~400 tokens a second, some 10-20x a 2-core CPU's prefill.  A fixed 5 s cut an
# 11.7K-token checkpoint (470 MB: 4-5 s from an idle local Redis, more on a busy machine) off
# into a cold prefill of 330-720 s; at 32 MB/s the replica's load took 17.9 s of its 19.7 s.
READ_FLOOR_BPS = 16 << 20


@dataclass(slots=True, frozen=True)
class TierSettings:
    fingerprint: bytes  # the model pair and KV layout (sessions.layer.kv_fingerprint)
    budget_bytes: int
    secret: bytes  # keys every entry's checksum and every note's tag
    queue_bytes: int = 2 << 30  # bytes of writes waiting at most; past it a write is skipped
    timeout_s: float = 5.0  # the model thread waits this long for one lookup


class KVTier(abc.ABC):
    """What both backends share: naming, framing and checks, the writer and reader threads,
    the deadline, counters."""

    where = ""  # for logs: the folder or the Redis URL (without its password)

    def __init__(self, s: TierSettings) -> None:
        self.fingerprint = hashlib.sha256(s.fingerprint).digest()
        self.tag = self.fingerprint.hex()[:16]
        self.budget, self.queue_max, self.timeout_s = s.budget_bytes, s.queue_bytes, s.timeout_s
        self._key = hashlib.blake2b(s.secret, digest_size=32, person=b"specgate-tier").digest()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="specgate-kv-tier")
        self._reader = ThreadPoolExecutor(2, thread_name_prefix="specgate-kv-tier-read")
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self._queued = 0  # bytes of writes waiting
        self._used = 0  # bytes of entries, as this process knows it (read by /metrics)
        self._down_until = 0.0
        self._closed = False
        self.hits = self.misses = self.writes = self.rejected = self.write_failures = 0
        self.skipped = 0  # writes not made: the queue was full, or the tier closing
        self.timeouts = 0  # lookups that missed their deadline

    @staticmethod
    def name(key: str) -> str:
        return hashlib.sha256(key.encode()).hexdigest()[:40]

    # -- what a backend provides -------------------------------------------------
    @abc.abstractmethod
    def _read(self, name: str) -> bytes | None:
        """The entry's bytes, None when absent; :class:`Refused` when it may not be read."""

    @abc.abstractmethod
    def _store(self, name: str, data: bytes) -> None:
        """Store an entry whole or not at all (raises on failure)."""

    @abc.abstractmethod
    def _delete(self, name: str) -> None: ...

    def _exists(self, name: str) -> bool:
        return self._size(name) is not None

    @abc.abstractmethod
    def _size(self, name: str) -> int | None:
        """The entry's stored size in bytes, None when absent (no body read)."""

    @abc.abstractmethod
    def _touch(self, name: str) -> None:
        """Recently used: the last to go."""

    @abc.abstractmethod
    def _make_room(self, incoming: int) -> None:
        """Drop entries, least recently used first, until ``incoming`` fits; sets ``_used``."""

    @abc.abstractmethod
    def _read_note_raw(self, name: str) -> bytes | None: ...

    @abc.abstractmethod
    def _write_note_raw(self, name: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def delete_note(self, name: str) -> None: ...

    @property
    def bytes_used(self) -> int:
        """Bytes of entries, from a counter (no I/O: ``/metrics`` reads it)."""
        return self._used

    # -- lookups: the model thread, under a deadline --------------------------------------
    def has(self, key: str) -> bool:
        return bool(self._bounded(self._exists, self.name(key), default=False))

    def get(self, key: str) -> Blobs | None:
        """The entry's blobs, or None: absent, being written, failing a check (then deleted),
        or not read within the deadline."""
        size = self._bounded(self._size, self.name(key), default=None)
        deadline_s = self.read_deadline_s(min(size or 0, self.budget))
        blobs = None if size is None else self._bounded(self.read_entry, key, None, deadline_s)
        if blobs is None:
            self.misses += 1
        return blobs

    def note(self, name: str) -> bytes | None:
        return self._bounded(self.read_note, name, default=None)

    def read_deadline_s(self, size: int) -> float:
        """How long the model thread waits for an entry of ``size`` bytes to be read."""
        return self.timeout_s + size / READ_FLOOR_BPS

    def _bounded(self, fn: Callable[[str], T], arg: str, default: T, timeout_s: float | None = None) -> T:
        if self._closed or time.monotonic() < self._down_until:
            return default
        limit = self.timeout_s if timeout_s is None else timeout_s
        future = self._reader.submit(fn, arg)
        try:
            return future.result(timeout=limit)
        except concurrent.futures.TimeoutError:
            self.timeouts += 1
            self._down_until = time.monotonic() + BACKOFF_S
            log.warning("kv_tier_slow", where=self.where, timeout_s=round(limit, 1), backoff_s=BACKOFF_S)
            return default
        except Exception as exc:  # noqa: BLE001 -- a failed lookup is a miss, never a failed turn
            log.warning("kv_tier_read_failed", error=f"{type(exc).__name__}: {exc}")
            return default

    # -- reads and writes as they are (the tier's own threads) ---------------------------
    def read_entry(self, key: str) -> Blobs | None:
        name = self.name(key)
        try:
            data = self._read(name)
            if data is None:
                return None
            blobs = unframe(data, self.fingerprint, self._key)
        except ValueError as exc:  # Refused, or a check failed
            self._reject(name, str(exc))
            return None
        self._touch(name)
        self.hits += 1
        return blobs

    def _reject(self, name: str, why: str) -> None:
        self.rejected += 1
        log.warning("kv_tier_rejected", entry=name, error=why)
        self._delete(name)

    def read_note(self, name: str) -> bytes | None:
        """A note's data, or None: absent, or its tag fails (written without the secret)."""
        try:
            raw = self._read_note_raw(name)
        except Refused as exc:
            self.rejected += 1
            log.warning("kv_tier_note_rejected", note=name, error=str(exc))
            return None
        if raw is None:
            return None
        if len(raw) < TAG or not hmac.compare_digest(raw[:TAG], self._note_tag(name, raw[TAG:])):
            self.rejected += 1
            log.warning("kv_tier_note_rejected", note=name, error="tag mismatch")
            return None
        return raw[TAG:]

    def write_note(self, name: str, data: bytes) -> None:
        self._write_note_raw(name, self._note_tag(name, data) + data)

    def _note_tag(self, name: str, data: bytes) -> bytes:
        h = hashlib.blake2b(digest_size=TAG, key=self._key)
        h.update(name.encode() + b"\0")
        h.update(data)
        return h.digest()

    def drop(self, key: str) -> None:
        self._delete(self.name(key))

    def submit(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the writer thread, after the writes queued before it."""
        if self._closed:
            return
        with contextlib.suppress(RuntimeError):  # shut down meanwhile
            self._writer.submit(_logged, fn)

    def put(self, key: str, blobs: Blobs, then: Callable[[], None] | None = None, replace: bool = False) -> bool:
        """Queue the entry's write (an entry already there, or being written, stays unless
        ``replace``); ``then`` runs on the writer once the entry is there (not when its write
        failed or was skipped).  False when skipped: the queue is full or the tier closed."""
        size = len(blobs[0]) + len(blobs[1])
        with self._lock:
            if self._closed or self._queued + size > self.queue_max:
                self.skipped += 1
                log.info("kv_tier_write_skipped", reason="closed" if self._closed else "queue full",
                         bytes=size, queued=self._queued)
                return False
            if not replace and key in self._pending:
                if then is not None:
                    self._writer.submit(_logged, lambda: self._exists(self.name(key)) and then())
                return True
            self._pending.add(key)
            self._queued += size
            self._writer.submit(self._write, key, blobs, size, then, replace)  # under the lock: not yet closed
        return True

    def _write(self, key: str, blobs: Blobs, size: int, then: Callable[[], None] | None, replace: bool) -> None:
        name = self.name(key)
        try:
            if not replace and self._exists(name):
                if then is not None:
                    then()
                return
            data = frame(blobs, self.fingerprint, self._key)
            if len(data) > self.budget:
                return
            self._make_room(len(data))
            self._store(name, data)
            self._used += len(data)
            self.writes += 1
            if then is not None:
                then()
        except Exception as exc:  # noqa: BLE001 -- a failed write costs a recompute, never a turn
            self.write_failures += 1
            log.warning("kv_tier_write_failed", entry=name, bytes=size, error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._pending.discard(key)
                self._queued -= size

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the writes queued so far (at most ``timeout_s``); whether they all ran."""
        if self._closed:
            return True
        try:
            self._writer.submit(lambda: None).result(timeout_s)
            return True
        except concurrent.futures.TimeoutError:
            return False

    @property
    def queued_bytes(self) -> int:
        return self._queued

    def close(self, timeout_s: float = 30.0) -> None:
        """Let the writes under way land for up to ``timeout_s`` (a restart then finds them);
        the rest are dropped and counted as skipped.  Later writes are skipped."""
        if self._closed:
            return
        landed = self.flush(timeout_s)
        with self._lock:
            self._closed = True
            left = len(self._pending)
        self._writer.shutdown(wait=landed, cancel_futures=True)
        self._reader.shutdown(wait=False, cancel_futures=True)
        if not landed:
            self.skipped += left
            log.warning("kv_tier_close_timeout", timeout_s=timeout_s, writes_dropped=left)


def _logged(fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 -- a failed index or delete costs a recompute, never a turn
        log.warning("kv_tier_job_failed", error=f"{type(exc).__name__}: {exc}")


class DirectoryTier(KVTier):
    """Entries as files in ``<root>/<fingerprint>/prefixes`` (written through a temporary file,
    fsync and a rename: replicas on one shared folder may write at once), notes beside them in
    ``notes``; folders ``0700``, files ``0600`` (sessions.kv.private_files)."""

    def __init__(self, root: str | Path, s: TierSettings) -> None:
        super().__init__(s)
        base = private_dir(Path(root).expanduser())
        self.dir = private_dir(private_dir(base / self.tag) / "prefixes")
        self.notes = private_dir(self.dir.parent / "notes")
        self.where = str(base)
        self.partials_removed = sum(remove_partials(d, PARTIAL_AGE_S) for d in (self.dir, self.notes))
        if self.partials_removed:
            log.info("kv_tier_partials_removed", files=self.partials_removed)
        self._writer.submit(self._make_room, 0)  # counts what is there, off the caller's thread

    def path(self, key: str) -> Path:
        return self._file(self.name(key))

    def _file(self, name: str) -> Path:
        return self.dir / f"{name}.kv"

    def _read(self, name: str) -> bytes | None:
        return read_private(self._file(name), self.budget)

    def _store(self, name: str, data: bytes) -> None:
        write_private(self._file(name), data, sync=True)

    def _delete(self, name: str) -> None:
        path = self._file(name)
        with contextlib.suppress(OSError):
            size = path.lstat().st_size
            path.unlink()
            self._used = max(0, self._used - size)

    def _size(self, name: str) -> int | None:
        try:
            return self._file(name).stat().st_size
        except OSError:
            return None

    def _touch(self, name: str) -> None:
        with contextlib.suppress(OSError):
            Path(self._file(name)).touch(exist_ok=True)

    def _make_room(self, incoming: int) -> None:
        files = []
        for p in self.dir.glob("*.kv"):
            with contextlib.suppress(OSError):
                st = p.lstat()
                files.append((st.st_mtime, st.st_size, p))
        used = sum(size for _, size, _ in files)
        for _, size, p in sorted(files, key=lambda f: f[0]):
            if used + incoming <= self.budget:
                break
            p.unlink(missing_ok=True)
            used -= size
            log.info("kv_tier_dropped", file=p.name, reason="tier budget")
        self._used = used
        remove_partials(self.dir, PARTIAL_AGE_S)

    def _read_note_raw(self, name: str) -> bytes | None:
        return read_private(self.notes / name, NOTE_MAX)

    def _write_note_raw(self, name: str, data: bytes) -> None:
        write_private(self.notes / name, data, sync=False)

    def delete_note(self, name: str) -> None:
        (self.notes / name).unlink(missing_ok=True)
