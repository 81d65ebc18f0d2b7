"""The KV tier in Redis, for deployments that have Redis and no shared disk: every replica
that reaches the Redis restores what another computed.

An entry is stored in chunks (a Redis string holds at most 512 MB; an agent's prefix is
hundreds of MB), under a write id, and becomes visible only when its head key -- one SET,
naming the write id, the chunk count and the size -- is written after its chunks, so a
reader never sees half an entry; a chunk missing when read (evicted by Redis itself) makes the
entry a miss.  Every key carries a TTL, and the tier keeps its own byte budget, least
recently used first (a sorted set of last uses and a hash of sizes), so it can share a Redis
with the session records without crowding them out.  Keys are prefixed with the model pair's
fingerprint: another pair never reads them (the frame's check would refuse them anyway).
Calls are synchronous: reads on the model thread, writes on the tier's writer thread.
"""

from __future__ import annotations

import time
import uuid

import redis
import structlog

from sessions.kv.tier import KVTier

log = structlog.get_logger("specgate.sessions")
CHUNK = 32 << 20


class RedisTier(KVTier):
    def __init__(self, url: str, fingerprint: bytes, budget_bytes: int, ttl_s: int = 7 * 86400,
                 chunk_bytes: int = CHUNK) -> None:
        super().__init__(fingerprint, budget_bytes)
        self.client = redis.Redis.from_url(url, socket_timeout=30, socket_connect_timeout=5)
        self.ttl_s, self.chunk = ttl_s, chunk_bytes
        self.prefix = f"specgate:kvtier:{self.fingerprint.hex()[:16]}"
        self.lru, self.sizes = f"{self.prefix}:lru", f"{self.prefix}:sizes"
        pool = self.client.connection_pool.connection_kwargs
        self.where = f"redis://{pool.get('host', '?')}:{pool.get('port', '?')}/{pool.get('db', 0)}"

    def _head(self, name: str) -> str:
        return f"{self.prefix}:e:{name}"

    def _chunk(self, name: str, wid: str, i: int) -> str:
        return f"{self.prefix}:c:{name}:{wid}:{i}"

    def _read(self, name: str) -> bytes | None:
        try:
            head = self.client.get(self._head(name))
            if head is None:
                return None
            wid, n, size = _text(head).split(":")
            parts = self.client.mget([self._chunk(name, wid, i) for i in range(int(n))])
        except (redis.RedisError, ValueError) as exc:
            log.warning("kv_tier_read_failed", entry=name, error=f"{type(exc).__name__}: {exc}")
            return None
        if any(p is None for p in parts):
            return None  # a chunk evicted by Redis: a miss
        data = b"".join(_raw(p) for p in parts)
        return data if len(data) == int(size) else None

    def _store(self, name: str, data: bytes) -> None:
        wid, head = uuid.uuid4().hex[:12], self._head(name)
        chunks = [data[i:i + self.chunk] for i in range(0, len(data), self.chunk)] or [b""]
        for i, part in enumerate(chunks):  # one chunk per command: a pipeline would buffer them all
            self.client.set(self._chunk(name, wid, i), part, ex=self.ttl_s)
        old = self.client.get(head)
        with self.client.pipeline() as p:
            p.set(head, f"{wid}:{len(chunks)}:{len(data)}", ex=self.ttl_s)
            p.hset(self.sizes, name, len(data))
            p.zadd(self.lru, {name: time.time()})
            p.expire(self.sizes, self.ttl_s)
            p.expire(self.lru, self.ttl_s)
            p.execute()
        if old is not None:
            self._drop_chunks(name, _text(old))

    def _drop_chunks(self, name: str, head: str) -> None:
        wid, n, _ = head.split(":")
        self.client.delete(*[self._chunk(name, wid, i) for i in range(int(n))])

    def _delete(self, name: str) -> None:
        try:
            head = self.client.get(self._head(name))
            with self.client.pipeline() as p:
                p.delete(self._head(name))
                p.hdel(self.sizes, name)
                p.zrem(self.lru, name)
                p.execute()
            if head is not None:
                self._drop_chunks(name, _text(head))
        except redis.RedisError as exc:
            log.warning("kv_tier_delete_failed", entry=name, error=str(exc))

    def _exists(self, name: str) -> bool:
        try:
            return bool(self.client.exists(self._head(name)))
        except redis.RedisError:
            return False

    def _touch(self, name: str) -> None:
        try:
            self.client.zadd(self.lru, {name: time.time()})
        except redis.RedisError:
            pass

    def _make_room(self, incoming: int) -> None:
        sizes = {_text(k): int(v) for k, v in self.client.hgetall(self.sizes).items()}
        used = sum(sizes.values())
        for raw in self.client.zrange(self.lru, 0, -1):  # oldest first
            if used + incoming <= self.budget:
                break
            name = _text(raw)
            self._delete(name)
            used -= sizes.get(name, 0)
            log.info("kv_tier_dropped", entry=name, reason="tier budget")

    def read_note(self, name: str) -> bytes | None:
        try:
            value = self.client.get(f"{self.prefix}:n:{name}")
        except redis.RedisError:
            return None
        return _raw(value) if value is not None else None

    def write_note(self, name: str, data: bytes) -> None:
        self.client.set(f"{self.prefix}:n:{name}", data, ex=self.ttl_s)

    def delete_note(self, name: str) -> None:
        try:
            self.client.delete(f"{self.prefix}:n:{name}")
        except redis.RedisError:
            pass

    @property
    def bytes_used(self) -> int:
        try:
            return sum(int(v) for v in self.client.hvals(self.sizes))
        except redis.RedisError:
            return 0

    def close(self) -> None:
        super().close()
        self.client.close()


def _raw(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
