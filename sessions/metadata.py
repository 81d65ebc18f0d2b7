"""Session record stores: Redis (``redis.asyncio`` + orjson) or in-process.

Both expire a session's record ``ttl_s`` after its last write.  Redis errors
surface as :class:`StoreUnavailable` so the HTTP layer answers 503 precisely.
In Redis a record is written by one atomic script, and only while this
replica holds the session's lease (or nobody does) and the record's
``version`` grows: a replica that lost a session cannot overwrite the
history its new owner writes (see sessions/registry.py).
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis
import structlog
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.errors import StoreUnavailable

log = structlog.get_logger("specgate.store")

KEY_PREFIX = "specgate:session:"
LEASE_PREFIX = "specgate:lease:"
SAVE = """
local lease = redis.call('GET', KEYS[2])
if lease and lease ~= ARGV[3] then return 0 end
local cur = redis.call('GET', KEYS[1])
if cur then
  local ok, old = pcall(cjson.decode, cur)
  if ok and (tonumber(old['version']) or 0) >= tonumber(ARGV[4]) then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""


class MetadataStore(Protocol):
    kind: str

    async def save(self, session_id: str, meta: dict[str, Any]) -> bool: ...
    async def load(self, session_id: str) -> dict[str, Any] | None: ...
    async def delete(self, session_id: str) -> bool: ...
    async def ping(self) -> bool: ...
    async def close(self) -> None: ...


class MemoryStore:
    """The embedded default: same interface, same TTL semantics, one process."""

    kind = "memory"

    def __init__(self, ttl_s: int) -> None:
        self.ttl_s = ttl_s
        self._data: dict[str, tuple[float, bytes]] = {}

    async def save(self, session_id: str, meta: dict[str, Any]) -> bool:
        self._data[session_id] = (time.monotonic() + self.ttl_s, orjson.dumps(meta))
        return True

    async def load(self, session_id: str) -> dict[str, Any] | None:
        item = self._data.get(session_id)
        if item is None:
            return None
        if item[0] < time.monotonic():
            del self._data[session_id]
            return None
        result: dict[str, Any] = orjson.loads(item[1])
        return result

    async def delete(self, session_id: str) -> bool:
        return self._data.pop(session_id, None) is not None

    async def ping(self) -> bool:
        return True

    async def close(self) -> None:
        self._data.clear()


class RedisStore:
    kind = "redis"

    def __init__(self, url: str, ttl_s: int, timeout_s: float = 0.5, replica_id: str = "") -> None:
        self.url = url
        self.replica_id = replica_id
        self.ttl_s = ttl_s
        # short timeouts and one quick retry: a hung Redis costs a lookup about a second, and
        # writes never wait on it at all (they go through sessions.store_writer)
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1),
                                        retry_on_error=[RedisConnectionError, RedisTimeoutError])
        self._save = self._redis.register_script(SAVE)

    def _fail(self, exc: Exception) -> StoreUnavailable:
        """What failed, for the client; where (Redis's address, in redis-py's message), for the log."""
        log.warning("store_error", error=f"{type(exc).__name__}: {exc}")
        return StoreUnavailable("the session store (redis) is unavailable; retry shortly")

    @property
    def client(self) -> aioredis.Redis:
        return self._redis

    async def save(self, session_id: str, meta: dict[str, Any]) -> bool:
        """False: refused, because another replica holds the lease or a newer version is stored."""
        try:
            return bool(await self._save(keys=[KEY_PREFIX + session_id, LEASE_PREFIX + session_id],
                                         args=[orjson.dumps(meta), self.ttl_s, self.replica_id,
                                               int(meta.get("version", 0))]))
        except (RedisError, OSError) as exc:
            raise self._fail(exc) from exc

    async def load(self, session_id: str) -> dict[str, Any] | None:
        try:
            raw = await self._redis.get(KEY_PREFIX + session_id)
        except (RedisError, OSError) as exc:
            raise self._fail(exc) from exc
        if raw is None:
            return None
        result: dict[str, Any] = orjson.loads(raw)
        return result

    async def delete(self, session_id: str) -> bool:
        try:
            return bool(await self._redis.delete(KEY_PREFIX + session_id, LEASE_PREFIX + session_id))
        except (RedisError, OSError) as exc:
            raise self._fail(exc) from exc

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._redis.aclose()


def open_store(redis_url: str, ttl_s: int, replica_id: str = "") -> MetadataStore:
    return RedisStore(redis_url, ttl_s, replica_id=replica_id) if redis_url else MemoryStore(ttl_s)
