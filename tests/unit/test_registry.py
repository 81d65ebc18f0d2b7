"""The session registry on a real redis-server: leases, takeover, and versioned record writes."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis

from sessions.metadata import RedisStore
from sessions.registry import LEASE_PREFIX, REPLICA_PREFIX, RedisRegistry
from tests.support import until_async


async def test_one_owner_at_a_time_and_a_dead_owner_is_replaced(redis_server):
    client = aioredis.from_url(redis_server.url)
    a = RedisRegistry(client, "ra", "http://a", lease_ms=5000, heartbeat_ms=1000)
    b = RedisRegistry(client, "rb", "http://b", lease_ms=5000, heartbeat_ms=1000)
    await client.set(REPLICA_PREFIX + "ra", "http://a")
    await client.set(REPLICA_PREFIX + "rb", "http://b")
    assert await a.claim("o:s1") is None and await a.claim("o:s1") is None  # taken, then already ours
    assert await b.claim("o:s1") == "ra"  # a is alive: b is told who owns it
    assert await b.address("ra") == "http://a"
    assert not await b.take_over("o:s1", "rx") and await b.take_over("o:s1", "ra")  # only from the holder
    assert await a.claim("o:s1") == "rb"
    await client.delete(REPLICA_PREFIX + "rb")  # b's heartbeat lapses (SIGKILL)
    assert await a.claim("o:s1") is None
    assert await b.release(["o:s1"]) == 0 and await a.release(["o:s1"]) == 1
    assert await client.get(LEASE_PREFIX + "o:s1") is None
    await client.aclose()


async def test_racing_claims_have_exactly_one_winner(redis_server):
    client = aioredis.from_url(redis_server.url)
    regs = [RedisRegistry(client, f"r{i}", f"http://{i}") for i in range(8)]
    for r in regs:
        await client.set(REPLICA_PREFIX + r.replica_id, "x")
    results = await asyncio.gather(*(r.claim("o:race") for r in regs))
    winners = [r for r, res in zip(regs, results, strict=True) if res is None]
    assert len(winners) == 1 and all(res in (None, winners[0].replica_id) for res in results)
    await client.aclose()


async def test_renewal_reports_leases_another_replica_took(redis_server):
    client = aioredis.from_url(redis_server.url)
    a = RedisRegistry(client, "ka", "http://a", lease_ms=2000, heartbeat_ms=1000)
    await a.claim("o:kept")
    await a.claim("o:taken")
    await client.set(LEASE_PREFIX + "o:taken", "kb")
    lost: list[list[str]] = []
    a.start(lambda: ["o:kept", "o:taken"], lost.append)
    assert await until_async(lambda: bool(lost), 5)  # the first renewal reports it
    await a.stop()
    assert lost[0] == ["o:taken"] and await client.pttl(LEASE_PREFIX + "o:kept") > 1000
    assert await client.get(REPLICA_PREFIX + "ka") is None  # stop() withdraws the heartbeat
    await client.aclose()


async def test_record_writes_need_the_lease_and_a_growing_version(redis_server):
    a = RedisStore(redis_server.url, ttl_s=60, replica_id="wa")
    b = RedisStore(redis_server.url, ttl_s=60, replica_id="wb")
    assert await a.save("o:v", {"version": 1, "h": "a1"})  # nobody holds the lease
    await a.client.set(LEASE_PREFIX + "o:v", "wa")
    assert await a.save("o:v", {"version": 2, "h": "a2"})
    assert not await b.save("o:v", {"version": 9, "h": "b"})  # b does not own it
    assert not await a.save("o:v", {"version": 2, "h": "again"})  # no lost update: versions only grow
    assert (await b.load("o:v"))["h"] == "a2"
    await a.close()
    await b.close()


async def test_a_missing_lease_is_reclaimed_not_lost(redis_server):
    """After a Redis restart (or an outage longer than the lease) a held session's lease is
    simply gone: the renewal claims it again; only one another replica holds is lost."""
    client = aioredis.from_url(redis_server.url)
    a = RedisRegistry(client, "ma", "http://a", lease_ms=2000, heartbeat_ms=1000)
    await a.claim("o:held")
    await a.claim("o:taken")
    await client.delete(LEASE_PREFIX + "o:held")  # as an emptied Redis would have it
    await client.set(LEASE_PREFIX + "o:taken", "mb")
    lost: list[list[str]] = []
    a.start(lambda: ["o:held", "o:taken"], lost.append)
    assert await until_async(lambda: bool(lost), 5)
    await a.stop()
    assert lost == [["o:taken"]]
    assert await client.get(LEASE_PREFIX + "o:held") == b"ma" and await client.pttl(LEASE_PREFIX + "o:held") > 1000
    await client.aclose()
