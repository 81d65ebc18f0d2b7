"""The KV tier in Redis, for deployments that have Redis and no shared disk: every replica
that reaches the Redis restores what another computed.

An entry is stored in chunks (a Redis string holds at most 512 MB; an agent's prefix is
hundreds of MB) under a write id of its own, and becomes visible only when its head key --
naming the write id, the chunk count and the size -- is set after its chunks, in one
``SET ... GET`` that also returns the head it replaces, whose chunks then go: two replicas
writing one entry at once leave one whole entry and no orphans, and a write that fails
deletes the chunks it wrote.  A chunk missing when read (evicted by Redis itself) makes the
entry a miss and removes its head -- only if the head still names that write -- so the next
turn writes it again.  Every key carries a TTL, and the tier keeps its own byte budget,
least recently used first (a sorted set of last uses and a hash of sizes), which defaults to
a share of Redis's ``maxmemory`` when one is set, so it shares a Redis with the session
records without crowding them out.  Keys are prefixed with the layout's fingerprint.
Calls are synchronous, on the tier's own threads (sessions.kv.tier).
"""

from __future__ import annotations

import time
import uuid

import redis
import structlog

from sessions.kv.private_files import Refused
from sessions.kv.tier import KVTier, TierSettings

log = structlog.get_logger("specgate.sessions")
CHUNK = 32 << 20
MAXMEMORY_SHARE = 0.5  # of Redis's maxmemory, at most, for the tier's entries
# delete a head (and its size and LRU rows) only while it still names the write that was read
DROP_IF_SAME = """
if redis.call('get', KEYS[1]) == ARGV[1] then
  redis.call('del', KEYS[1]); redis.call('hdel', KEYS[2], ARGV[2]); redis.call('zrem', KEYS[3], ARGV[2])
  return 1
end
return 0
"""


class RedisTier(KVTier):
    def __init__(self, url: str, s: TierSettings, ttl_s: int = 7 * 86400, chunk_bytes: int = CHUNK) -> None:
        super().__init__(s)
        self.client = redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)
        self.ttl_s, self.chunk = ttl_s, chunk_bytes
        self.prefix = f"specgate:kvtier:{self.tag}"
        self.lru, self.sizes = f"{self.prefix}:lru", f"{self.prefix}:sizes"
        pool = self.client.connection_pool.connection_kwargs
        self.where = f"redis://{pool.get('host', '?')}:{pool.get('port', '?')}/{pool.get('db', 0)}"
        self.repaired = 0  # heads removed because a chunk was gone
        self.evicting_policy = ""  # Redis's maxmemory-policy when it may evict keys (session records too)
        self._drop_if_same = self.client.register_script(DROP_IF_SAME)
        self._writer.submit(self._check_server)

    def _check_server(self) -> None:
        """Writer thread, at start: fit the budget to ``maxmemory``, warn of an eviction policy
        that could take session records and leases, and count what is there."""
        try:
            config = self.client.config_get("maxmemory*")
        except redis.RedisError as exc:  # CONFIG renamed or refused: nothing to fit
            log.info("kv_tier_redis_config_unread", error=str(exc))
            config = {}
        maxmemory = int(config.get("maxmemory", 0) or 0)
        if maxmemory and self.budget > maxmemory * MAXMEMORY_SHARE:
            self.budget = int(maxmemory * MAXMEMORY_SHARE)
            log.info("kv_tier_budget_fitted", maxmemory=maxmemory, budget=self.budget)
        policy = str(config.get("maxmemory-policy", "noeviction"))
        if maxmemory and policy != "noeviction":
            self.evicting_policy = policy
            log.warning("kv_tier_redis_evicts", policy=policy,
                        detail="Redis may evict session records and leases under memory pressure: give the "
                               "KV tier a Redis of its own, or set maxmemory-policy noeviction")
        self._recount()

    def _recount(self) -> None:
        try:
            self._used = sum(int(v) for v in self.client.hvals(self.sizes))
        except redis.RedisError:
            pass

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
            if int(size) > self.budget or int(n) > int(size) // self.chunk + 1:
                raise Refused(f"a head naming {size} bytes in {n} chunks, over the tier's cap")
            parts = self.client.mget([self._chunk(name, wid, i) for i in range(int(n))])
        except Refused:
            raise
        except (redis.RedisError, ValueError) as exc:
            log.warning("kv_tier_read_failed", entry=name, error=f"{type(exc).__name__}: {exc}")
            return None
        if any(p is None for p in parts):  # a chunk evicted by Redis: a miss, and the entry goes
            self._repair(name, _text(head))
            return None
        data = b"".join(_raw(p) for p in parts)
        return data if len(data) == int(size) else None

    def _repair(self, name: str, head: str) -> None:
        try:
            if self._drop_if_same(keys=[self._head(name), self.sizes, self.lru], args=[head, name]):
                self.repaired += 1
                self._drop_chunks(name, head)
                log.info("kv_tier_repaired", entry=name, reason="a chunk was gone")
        except redis.RedisError as exc:
            log.warning("kv_tier_repair_failed", entry=name, error=str(exc))

    def _store(self, name: str, data: bytes) -> None:
        wid, head = uuid.uuid4().hex[:12], self._head(name)
        chunks = [data[i:i + self.chunk] for i in range(0, len(data), self.chunk)] or [b""]
        value = f"{wid}:{len(chunks)}:{len(data)}"
        try:
            for i, part in enumerate(chunks):  # one chunk per command: a pipeline would buffer them all
                self.client.set(self._chunk(name, wid, i), part, ex=self.ttl_s)
            old = self.client.set(head, value, ex=self.ttl_s, get=True)
        except BaseException:
            self._drop_chunks(name, value, quiet=True)
            raise
        with self.client.pipeline() as p:
            p.hset(self.sizes, name, len(data))
            p.zadd(self.lru, {name: time.time()})
            p.expire(self.sizes, self.ttl_s)
            p.expire(self.lru, self.ttl_s)
            p.execute()
        if old is not None and _text(old) != value:
            self._drop_chunks(name, _text(old))

    def _drop_chunks(self, name: str, head: str, quiet: bool = False) -> None:
        try:
            wid, n, _ = head.split(":")
            self.client.delete(*[self._chunk(name, wid, i) for i in range(int(n))])
        except (redis.RedisError, ValueError):
            if not quiet:
                raise

    def _delete(self, name: str) -> None:
        try:
            head = self.client.get(self._head(name))
            size = self.client.hget(self.sizes, name)
            with self.client.pipeline() as p:
                p.delete(self._head(name))
                p.hdel(self.sizes, name)
                p.zrem(self.lru, name)
                p.execute()
            if head is not None:
                self._drop_chunks(name, _text(head))
            if size is not None:
                self._used = max(0, self._used - int(size))
        except (redis.RedisError, ValueError) as exc:
            log.warning("kv_tier_delete_failed", entry=name, error=str(exc))

    def _size(self, name: str) -> int | None:
        try:
            head = self.client.get(self._head(name))
            return None if head is None else int(_text(head).split(":")[2])
        except (redis.RedisError, ValueError, IndexError):
            return None

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
        self._used = used

    def _read_note_raw(self, name: str) -> bytes | None:
        try:
            value = self.client.get(f"{self.prefix}:n:{name}")
        except redis.RedisError:
            return None
        return _raw(value) if value is not None else None

    def _write_note_raw(self, name: str, data: bytes) -> None:
        self.client.set(f"{self.prefix}:n:{name}", data, ex=self.ttl_s)

    def delete_note(self, name: str) -> None:
        try:
            self.client.delete(f"{self.prefix}:n:{name}")
        except redis.RedisError:
            pass

    def close(self, timeout_s: float = 30.0) -> None:
        super().close(timeout_s)
        self.client.close()


def _raw(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
