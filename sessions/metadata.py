"""Session metadata stores: Redis (``redis.asyncio`` + orjson) or in-process.

Both expire a session's record ``ttl_s`` after its last write.  Redis errors
surface as :class:`StoreUnavailable` so the HTTP layer answers 503 precisely.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import orjson
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core.errors import StoreUnavailable

KEY_PREFIX = "specgate:session:"


class MetadataStore(Protocol):
    kind: str

    async def save(self, session_id: str, meta: dict[str, Any]) -> None: ...
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

    async def save(self, session_id: str, meta: dict[str, Any]) -> None:
        self._data[session_id] = (time.monotonic() + self.ttl_s, orjson.dumps(meta))

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

    def __init__(self, url: str, ttl_s: int, timeout_s: float = 0.5) -> None:
        self.url = url
        self.ttl_s = ttl_s
        # short timeouts and one quick retry: a hung Redis costs a lookup about a second, and
        # writes never wait on it at all (they go through sessions.store_writer)
        self._redis = aioredis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
                                        retry=Retry(ExponentialBackoff(cap=0.2, base=0.05), 1),
                                        retry_on_error=[RedisConnectionError, RedisTimeoutError])

    def _fail(self, exc: Exception) -> StoreUnavailable:
        return StoreUnavailable(f"session store (redis) unavailable: {exc}")

    async def save(self, session_id: str, meta: dict[str, Any]) -> None:
        try:
            await self._redis.set(KEY_PREFIX + session_id, orjson.dumps(meta), ex=self.ttl_s)
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
            return bool(await self._redis.delete(KEY_PREFIX + session_id))
        except (RedisError, OSError) as exc:
            raise self._fail(exc) from exc

    async def ping(self) -> bool:
        try:
            return bool(await self._redis.ping())
        except (RedisError, OSError):
            return False

    async def close(self) -> None:
        await self._redis.aclose()


def open_store(redis_url: str, ttl_s: int) -> MetadataStore:
    return RedisStore(redis_url, ttl_s) if redis_url else MemoryStore(ttl_s)
