"""Which replica owns which session: leases in Redis (the session registry).

Every replica heartbeats ``specgate:replica:{id}`` (its advertised URL, a
short TTL) and holds a lease ``specgate:lease:{owner}:{session}`` (its replica
id, a longer TTL renewed while it keeps the session).  :meth:`claim` is one
atomic script: the lease is taken when it is free, already ours, or held by
a replica whose heartbeat is gone (so a SIGKILLed replica's sessions move in
about ``heartbeat_ms``, not ``lease_ms``); otherwise it names the live owner.
A session's record carries a version, and the store writes it only while
this replica holds the lease and the version grows (see
:class:`~sessions.metadata.RedisStore`), so two replicas can never both write
a history.  Without Redis, :class:`LocalRegistry` makes this replica the
owner of everything.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any, Protocol

import structlog
from redis.exceptions import RedisError

from core.errors import StoreUnavailable
from sessions.metadata import LEASE_PREFIX

log = structlog.get_logger("specgate.registry")
REPLICA_PREFIX = "specgate:replica:"
__all__ = ["LEASE_PREFIX", "REPLICA_PREFIX", "LocalRegistry", "RedisRegistry", "Registry"]

CLAIM = """
local cur = redis.call('GET', KEYS[1])
if cur and cur ~= ARGV[1] and redis.call('EXISTS', ARGV[3] .. cur) == 1 then
  return cur
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return false
"""
# a lease that is gone (Redis restarted empty, or an outage outlasted it) is claimed again; only
# one another replica holds means the session moved
RENEW = """
local lost = {}
for i, key in ipairs(KEYS) do
  local cur = redis.call('GET', key)
  if cur == ARGV[1] then
    redis.call('PEXPIRE', key, ARGV[2])
  elseif not cur then
    redis.call('SET', key, ARGV[1], 'PX', ARGV[2], 'NX')
  else
    table.insert(lost, key)
  end
end
return lost
"""
TAKEOVER = """
if redis.call('GET', KEYS[1]) == ARGV[2] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
  return 1
end
return 0
"""
RELEASE = """
local n = 0
for i, key in ipairs(KEYS) do
  if redis.call('GET', key) == ARGV[1] then
    n = n + redis.call('DEL', key)
  end
end
return n
"""


class Registry(Protocol):
    replica_id: str

    async def claim(self, key: str) -> str | None: ...
    async def take_over(self, key: str, dead: str) -> bool: ...
    async def address(self, replica_id: str) -> str | None: ...
    async def release(self, keys: list[str]) -> int: ...
    def start(self, held: Callable[[], list[str]], on_lost: Callable[[list[str]], None]) -> None: ...
    async def stop(self) -> None: ...


class LocalRegistry:
    """One replica: it owns every session."""

    def __init__(self, replica_id: str = "local") -> None:
        self.replica_id = replica_id

    async def claim(self, key: str) -> str | None:
        return None

    async def take_over(self, key: str, dead: str) -> bool:
        return True

    async def address(self, replica_id: str) -> str | None:
        return None

    async def release(self, keys: list[str]) -> int:
        return 0

    def start(self, held: Callable[[], list[str]], on_lost: Callable[[list[str]], None]) -> None:
        return None

    async def stop(self) -> None:
        return None


def _unavailable(exc: Exception) -> StoreUnavailable:
    """What failed, for the client; where (Redis's address, in redis-py's message), for the log."""
    log.warning("registry_error", error=f"{type(exc).__name__}: {exc}")
    return StoreUnavailable("the session registry (redis) is unavailable; retry shortly")


class RedisRegistry:
    def __init__(self, redis: Any, replica_id: str, advertise_url: str, lease_ms: int = 15000,
                 heartbeat_ms: int = 3000) -> None:
        self.redis = redis
        self.replica_id = replica_id or f"r-{uuid.uuid4().hex[:8]}"
        self.advertise_url = advertise_url
        self.lease_ms, self.heartbeat_ms = lease_ms, heartbeat_ms
        self._claim = redis.register_script(CLAIM)
        self._renew = redis.register_script(RENEW)
        self._release = redis.register_script(RELEASE)
        self._take_over = redis.register_script(TAKEOVER)
        self._task: asyncio.Task[None] | None = None

    async def claim(self, key: str) -> str | None:
        """None: this replica owns ``key`` now; else the live owner's replica id."""
        try:
            owner = await self._claim(keys=[LEASE_PREFIX + key],
                                      args=[self.replica_id, self.lease_ms, REPLICA_PREFIX])
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from exc
        return owner.decode() if owner else None

    async def take_over(self, key: str, dead: str) -> bool:
        """Take ``key`` from ``dead`` (an owner that cannot be reached), only if it still holds it."""
        try:
            return bool(await self._take_over(keys=[LEASE_PREFIX + key], args=[self.replica_id, dead, self.lease_ms]))
        except (RedisError, OSError) as exc:
            raise _unavailable(exc) from exc

    async def address(self, replica_id: str) -> str | None:
        try:
            url = await self.redis.get(REPLICA_PREFIX + replica_id)
        except (RedisError, OSError):
            return None
        return url.decode() if url else None

    async def release(self, keys: list[str]) -> int:
        if not keys:
            return 0
        with contextlib.suppress(RedisError, OSError):
            return int(await self._release(keys=[LEASE_PREFIX + k for k in keys], args=[self.replica_id]))
        return 0

    def start(self, held: Callable[[], list[str]], on_lost: Callable[[list[str]], None]) -> None:
        """``held()``: the keys of the sessions this replica keeps (their leases are renewed);
        ``on_lost(keys)``: leases another replica took meanwhile (a lease that is simply gone
        is claimed again)."""
        self._task = asyncio.create_task(self._beat(held, on_lost), name="specgate-registry")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(RedisError, OSError):
            await self.redis.delete(REPLICA_PREFIX + self.replica_id)

    async def _beat(self, held: Callable[[], list[str]], on_lost: Callable[[list[str]], None]) -> None:
        every = min(self.heartbeat_ms, self.lease_ms) / 3000
        while True:
            try:
                await self.redis.set(REPLICA_PREFIX + self.replica_id, self.advertise_url, px=self.heartbeat_ms)
                keys = list(held())
                if keys:
                    lost = await self._renew(keys=[LEASE_PREFIX + k for k in keys],
                                             args=[self.replica_id, self.lease_ms])
                    if lost:
                        on_lost([k.decode()[len(LEASE_PREFIX):] for k in lost])
            except (RedisError, OSError) as exc:
                log.warning("registry_heartbeat_failed", error=str(exc))
            await asyncio.sleep(every)
