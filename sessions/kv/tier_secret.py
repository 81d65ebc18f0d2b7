"""The deployment's KV tier secret: it keys every tier entry's checksum and every note's tag
(sessions.kv.tier), so a file or Redis value written by anyone without it is refused.

``--kv-tier-secret`` (``SPECGATE_KV_TIER_SECRET``) names it; every replica that shares a tier
needs the same one.  Without it, one is generated once into the cache folder
(``kv-tier.secret``, ``0600``) and read from there after: replicas on one machine share it."""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

import structlog

from sessions.kv.private_files import Refused, private_dir, read_private, write_private

log = structlog.get_logger("specgate.sessions")
FILE = "kv-tier.secret"


def tier_secret(configured: str, cache_dir: Path) -> bytes:
    if configured:
        return configured.encode()
    path = private_dir(cache_dir) / FILE
    try:
        if (found := read_private(path, 4096)) is not None and found.strip():
            return found.strip()
    except Refused as exc:
        raise OSError(f"{path} is not a private file ({exc}): remove it, or set --kv-tier-secret") from exc
    fresh = secrets.token_hex(32).encode()
    tmp = path.with_name(f"{FILE}.{os.getpid()}")
    write_private(tmp, fresh, sync=True)
    try:
        os.link(tmp, path)  # never over a secret another process wrote meanwhile: then theirs is the one
        log.info("kv_tier_secret_generated", file=str(path))
    except FileExistsError:
        pass
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()
    found = read_private(path, 4096)
    if not found or not found.strip():
        raise OSError(f"{path} holds no secret: remove it, or set --kv-tier-secret")
    return found.strip()
