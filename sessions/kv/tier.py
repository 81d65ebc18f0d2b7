"""A KV tier that outlives the process: shared prefixes' KV in a directory, so a restarted
server, or another replica pointed at the same folder (a shared mount), restores a system
prompt's KV instead of prefilling it again.  On a CPU, reading a prefix's KV (about 40 KiB a
token for the Qwen pair in f16) takes a fraction of a second; prefilling a 14K-token prompt
took minutes.

An entry is named by a hash of its prefix-cache key (the owner and the exact tokens: one key
never finds another's) and framed like a spill file (sessions.kv.parked: magic, the model
pair's fingerprint, lengths, checksum).  Writes go through a temporary file, fsync and a
rename, on a thread of their own, off the model thread; a file that fails a check is deleted
and recomputed, never loaded.  The folder is kept within a byte budget, least recently used
first (a read refreshes a file's time).
"""

from __future__ import annotations

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


class DirectoryTier:
    def __init__(self, root: str | Path, fingerprint: bytes, budget_bytes: int) -> None:
        self.dir = Path(root).expanduser() / "prefixes"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.fingerprint = hashlib.sha256(fingerprint).digest()
        self.budget = budget_bytes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="specgate-kv-tier")
        self._pending: set[str] = set()
        self._lock = threading.Lock()
        self.hits = self.misses = self.writes = self.rejected = self.write_failures = 0

    def path(self, key: str) -> Path:
        return self.dir / f"{hashlib.sha256(key.encode()).hexdigest()[:40]}.kv"

    def get(self, key: str) -> Blobs | None:
        """The entry's blobs, or None (absent, being written, or failing a check: then deleted)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except OSError:
            self.misses += 1
            return None
        try:
            blobs = unframe(data, self.fingerprint)
        except ValueError as exc:
            self.rejected += 1
            log.warning("kv_tier_rejected", file=path.name, error=str(exc))
            path.unlink(missing_ok=True)
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the last to go
        self.hits += 1
        return blobs

    def put(self, key: str, blobs: Blobs, then: Callable[[], None] | None = None) -> None:
        """Write the entry in the background (an entry already there, or being written, stays);
        ``then`` runs on the writer once the entry is there (not when its write failed)."""
        with self._lock:
            if key in self._pending or self.path(key).exists():
                if then is not None:  # one writer thread: after the write under way, if any
                    self._writer.submit(lambda: self.path(key).exists() and then())
                return
            self._pending.add(key)
        self._writer.submit(self._write, key, blobs, then)

    def _write(self, key: str, blobs: Blobs, then: Callable[[], None] | None = None) -> None:
        path = self.path(key)
        tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}.partial")  # replicas may write at once
        data = frame(blobs, self.fingerprint)
        try:
            if len(data) > self.budget:
                return
            self._make_room(len(data))
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(path)
            self.writes += 1
            if then is not None:
                then()
        except OSError as exc:
            self.write_failures += 1
            log.warning("kv_tier_write_failed", file=path.name, bytes=len(data), error=str(exc))
            tmp.unlink(missing_ok=True)
        finally:
            with self._lock:
                self._pending.discard(key)

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

    @property
    def bytes_on_disk(self) -> int:
        total = 0
        for p in self.dir.glob("*.kv"):
            with contextlib.suppress(OSError):
                total += p.stat().st_size
        return total

    def flush(self) -> None:
        """Wait for the writes queued so far."""
        self._writer.submit(lambda: None).result()

    def close(self) -> None:
        """Finish the writes under way (a restart then finds them)."""
        self._writer.shutdown(wait=True)
