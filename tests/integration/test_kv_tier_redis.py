"""The KV tier's Redis backend against a real redis-server: entries round-trip in chunks and
another process finds them; a damaged or missing chunk, or another model pair, is a miss,
never a load; the byte budget drops the least recently used; session checkpoints work over
it; and a restarted gateway on the tiny pair restores a prefix from it."""

from __future__ import annotations

import httpx
import pytest
import redis

from gateway import keys
from sessions.kv.checkpoints import SessionCheckpoints
from sessions.kv.tier import TierSettings
from sessions.kv.tier_redis import RedisTier
from tests.support import start_gateway

pytestmark = pytest.mark.redis
BLOBS = (b"target-kv" * 1000, b"speculator-kv" * 500)  # 15.5 KB: 16 chunks of 1 KB


def tier(redis_server, fingerprint: bytes, budget: int = 1 << 20) -> RedisTier:
    """Each test names its own model pair: one Redis serves them all, under separate keys."""
    return RedisTier(redis_server.url, TierSettings(fingerprint, budget, b"secret"), chunk_bytes=1024)


def written(t: RedisTier, key: str) -> None:
    t.put(key, BLOBS)
    t.flush()


def test_an_entry_round_trips_in_chunks_and_another_process_finds_it(redis_server):
    a = tier(redis_server, b"round-trip")
    assert a.get("k") is None and a.misses == 1
    written(a, "k")
    client = redis.Redis.from_url(redis_server.url)
    assert len(client.keys(f"{a.prefix}:c:*")) == 16
    b = tier(redis_server, b"round-trip")  # a restarted process, or another replica on the same Redis
    assert b.has("k") and b.get("k") == BLOBS and b.hits == 1
    assert b.bytes_used > len(BLOBS[0]) + len(BLOBS[1])
    assert all(0 < client.ttl(k) <= 7 * 86400 for k in client.keys(f"{a.prefix}:*"))
    a.close()
    b.close()


def test_a_damaged_or_missing_chunk_or_another_pair_is_never_loaded(redis_server):
    t = tier(redis_server, b"damage")
    client = redis.Redis.from_url(redis_server.url)
    written(t, "k")
    (chunk,) = [k for k in client.keys(f"{t.prefix}:c:*") if k.endswith(b":3")]
    client.set(chunk, b"x" * 1024)  # same length, other bytes: the checksum catches it
    assert t.get("k") is None and t.rejected == 1 and not t.has("k")
    written(t, "k")
    (chunk,) = [k for k in client.keys(f"{t.prefix}:c:*") if k.endswith(b":5")]
    client.delete(chunk)  # evicted by Redis itself
    assert t.get("k") is None
    other = tier(redis_server, b"damage-other-pair")  # another model pair or KV type: other keys
    assert other.get("k") is None and not other.has("k")


def test_the_budget_drops_the_least_recently_used(redis_server):
    one = len(BLOBS[0]) + len(BLOBS[1]) + 100
    t = tier(redis_server, b"budget", budget=2 * one)
    written(t, "a")
    written(t, "b")
    assert t.get("a") == BLOBS  # a read makes it the newest: b is now the oldest
    written(t, "c")
    assert not t.has("b") and t.get("a") == BLOBS and t.get("c") == BLOBS
    assert t.bytes_used <= 2 * one


def test_session_checkpoints_work_over_redis(redis_server):
    t = tier(redis_server, b"checkpoints")
    cp = SessionCheckpoints(t, min_new_tokens=16)
    tokens = tuple(range(300))
    cp.write("alice:s1", "alice", tokens, BLOBS)
    t.flush()
    other = SessionCheckpoints(tier(redis_server, b"checkpoints"), min_new_tokens=16)  # another replica
    assert other.find("alice:s1", "alice", (*tokens, 1)) == (300, 300, BLOBS)
    assert other.find("alice:s1", "bob", (*tokens, 1)) is None
    other.forget("alice:s1", "alice")
    other.tier.flush()
    assert cp.find("alice:s1", "alice", (*tokens, 1)) is None


SYSTEM = ("You operate the plant. Units report flow, pressure and temperature every minute; alarms name "
          "the unit, the reading and the limit it crossed. ") * 40  # ~1.2K tokens


def test_a_restarted_gateway_restores_a_prefix_from_redis(tiny_target, tiny_speculator, redis_server):
    def converse(base: str, sid: str, question: str) -> dict:
        r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                       json={"messages": [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": question}],
                             "max_tokens": 4, "specprefill": False})
        assert r.status_code == 200, r.text
        return r.json()["timings"]

    first = start_gateway(tiny_target, tiny_speculator, engine={"slots": 1}, kv_tier_dir=redis_server.url)
    try:
        converse(first.base, "t-1", "Which unit alarmed?")
        n = converse(first.base, "t-2", "Report unit 7.")["prefix_built_n"]  # seen twice: built and written
        assert n > 1000
    finally:
        first.stop()  # closing waits for the tier's writes
    again = start_gateway(tiny_target, tiny_speculator, engine={"slots": 1}, kv_tier_dir=redis_server.url)
    try:
        t = converse(again.base, "t-3", "Report unit 9.")
        assert t["prefix_shared_n"] == n and t["prefix_built_n"] == 0 and t["prompt_n"] == t["context_n"] - n
        assert t["prefix_source"] == "tier" and t["prefix_bytes"] > 0
    finally:
        again.stop()


def test_a_missing_chunk_removes_its_head_so_the_entry_is_written_again(redis_server):
    t = tier(redis_server, b"repair")
    client = redis.Redis.from_url(redis_server.url)
    written(t, "k")
    client.delete(next(k for k in client.keys(f"{t.prefix}:c:*")))  # evicted by Redis itself
    assert t.get("k") is None and t.repaired == 1
    assert not t.has("k") and client.keys(f"{t.prefix}:c:*") == []  # head and the other chunks gone
    written(t, "k")
    assert t.get("k") == BLOBS


def test_a_failed_write_leaves_no_chunks_and_concurrent_writes_leave_one_entry(redis_server):
    import threading

    t = tier(redis_server, b"writes")
    client = redis.Redis.from_url(redis_server.url)
    name = t.name("k")
    # a write that fails midway (Redis refuses writes past maxmemory): the chunks it wrote go
    client.config_set("maxmemory", client.info("memory")["used_memory"] + 6000)
    try:
        with pytest.raises(redis.RedisError):
            t._store(name, b"x" * 20000)
    finally:
        client.config_set("maxmemory", 0)
    assert client.keys(f"{t.prefix}:c:*") == [] and not t.has("k")
    # two replicas write one entry at once, many times: one head, and only its chunks
    other = tier(redis_server, b"writes")
    payloads = [bytes([i]) * 5000 for i in range(2)]

    def writer(tr: RedisTier, data: bytes) -> None:
        for _ in range(20):
            tr._store(name, data)

    threads = [threading.Thread(target=writer, args=(tr, d)) for tr, d in zip((t, other), payloads, strict=True)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wid, n, _ = client.get(t._head(name)).decode().split(":")
    chunks = sorted(k.decode() for k in client.keys(f"{t.prefix}:c:*"))
    assert chunks == sorted(t._chunk(name, wid, i) for i in range(int(n)))


def test_the_budget_fits_redis_maxmemory_and_an_evicting_policy_is_reported():
    from tests.support import RedisServer

    server = RedisServer()
    try:
        server.client.config_set("maxmemory", 64 << 20)
        server.client.config_set("maxmemory-policy", "allkeys-lru")
        t = RedisTier(server.url, TierSettings(b"fit", 1 << 30, b"secret"))
        t.flush()  # the check runs on the writer thread, off the caller's
        assert t.budget == 32 << 20 and t.evicting_policy == "allkeys-lru"
        server.client.config_set("maxmemory-policy", "noeviction")
        quiet = RedisTier(server.url, TierSettings(b"fit", 1 << 30, b"secret"))
        quiet.flush()
        assert quiet.evicting_policy == "" and quiet.budget == 32 << 20
    finally:
        server.stop()


def test_nothing_waits_on_a_paused_redis(tiny_target, tiny_speculator):
    """``CLIENT PAUSE`` holds every command: ``/metrics`` still answers at once (it reads
    counters), and a lookup on the model thread's behalf gives up at its deadline and then
    misses at once for a while."""
    import time

    from tests.support import RedisServer

    server = RedisServer()
    gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 1}, kv_tier_dir=server.url,
                       kv_tier_timeout_s=0.5)
    try:
        t = gw.app[keys.MANAGER].residency.prefixes.tier
        assert httpx.get(gw.base + "/metrics", timeout=10).status_code == 200
        server.client.client_pause(4000)
        t0 = time.perf_counter()
        r = httpx.get(gw.base + "/metrics", timeout=10)
        assert r.status_code == 200 and time.perf_counter() - t0 < 1.0
        t0 = time.perf_counter()
        assert t.get("anything") is None and t.timeouts == 1 and time.perf_counter() - t0 < 2.0
        t0 = time.perf_counter()
        assert not t.has("anything") and time.perf_counter() - t0 < 0.1  # backing off: no wait at all
    finally:
        gw.stop()
        server.stop()
