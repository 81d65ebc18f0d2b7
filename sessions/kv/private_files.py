"""Files that hold KV or its indexes: private to the server's user, written whole or not at
all, and read without trusting what is on disk.

KV bytes are what a model computed from a client's prompt, so another local user must not
read them, and nothing another user (or a stray process) puts in the folder may be loaded:
folders are ``0700`` and files ``0600``, created with ``O_EXCL`` and ``O_NOFOLLOW``; a read
refuses a symlink, anything but a regular file and a file over its size cap before reading a
byte.  What a read returns is still checked by its caller (a keyed checksum)."""

from __future__ import annotations

import contextlib
import os
import stat
import time
import uuid
from pathlib import Path

import structlog

log = structlog.get_logger("specgate.sessions")
PARTIAL = ".partial"


class Refused(ValueError):
    """A file that is there but may not be read: a symlink, not a regular file, too large."""


def private_dir(path: Path) -> Path:
    """``path`` created (with its parents) and made ``0700``; a folder owned by another user
    (a shared mount) keeps its mode, with a warning."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        if stat.S_IMODE(path.stat().st_mode) != 0o700:
            os.chmod(path, 0o700)
    except PermissionError:
        log.warning("kv_folder_not_private", folder=str(path))
    return path


def write_private(path: Path, data: bytes, sync: bool) -> None:
    """``data`` at ``path``, mode ``0600``, through a temporary file renamed over it (readers see
    the old file or the new one, never half of one)."""
    tmp = path.with_name(f"{path.stem}.{uuid.uuid4().hex[:8]}{PARTIAL}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if sync:
                f.flush()
                os.fsync(f.fileno())
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_private(path: Path, max_bytes: int) -> bytes | None:
    """The file's bytes; None when there is none; :class:`Refused` for a symlink, something
    other than a regular file, or more than ``max_bytes``."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as exc:  # ELOOP: a symlink
        raise Refused(f"not readable as a private file: {exc.strerror}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a regular file")
        if st.st_size > max_bytes:
            raise Refused(f"{st.st_size} bytes, over the cap of {max_bytes}")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise Refused(f"grew past the cap of {max_bytes} while read")
    return data


def remove_partials(folder: Path, older_than_s: float) -> int:
    """Remove the temporary files a killed writer left (those older than ``older_than_s``: a
    replica sharing the folder may be writing the newer ones); returns how many."""
    cutoff, n = time.time() - older_than_s, 0
    for path in folder.glob(f"*{PARTIAL}"):
        with contextlib.suppress(OSError):
            if path.lstat().st_mtime <= cutoff:
                path.unlink()
                n += 1
    return n
