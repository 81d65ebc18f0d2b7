"""Session building blocks without models: parked KV, admission, metadata stores."""

from __future__ import annotations

import asyncio

import pytest

from core.errors import QueueFull, StoreUnavailable
from core.prompt import Prompt, Span
from sessions.admission import FairAdmission
from sessions.kv.parked import ParkedKV
from sessions.kv.prefixes import PrefixCache, prefix_end
from sessions.metadata import MemoryStore, RedisStore
from tests.support import until_async


def test_parked_kv_lru_budget_and_drop():
    kv = ParkedKV(budget_bytes=100)
    assert kv.put("a", (b"x" * 30, b"y" * 10)) == []
    assert kv.put("b", (b"x" * 40, b"")) == []
    assert kv.bytes_in_ram == 80
    assert kv.take("a") == (b"x" * 30, b"y" * 10)  # taking refreshes nothing: a is gone from RAM
    kv.put("a", (b"x" * 30, b"y" * 10))
    assert kv.put("c", (b"z" * 50, b"")) == ["b"]  # b is least recently stored
    assert kv.where("b") == "none" and kv.take("b") is None
    assert kv.bytes_in_ram == 90 and kv.evictions == 1


def test_parked_kv_spills_to_disk(tmp_path):
    kv = ParkedKV(budget_bytes=10, spill_dir=str(tmp_path))
    kv.put("a", (b"targ", b"spec"))
    assert kv.put("b", (b"0123456789", b"")) == ["a"]
    assert kv.where("a") == "disk"
    assert kv.take("a") == (b"targ", b"spec")
    assert kv.where("a") == "none"
    kv.discard("b")
    assert kv.bytes_in_ram == 0


def test_a_prefix_is_peeked_as_most_recently_used_and_dropped_not_spilled(tmp_path):
    kv = ParkedKV(budget_bytes=20, spill_dir=str(tmp_path))
    kv.put("prefix", (b"p" * 8, b""), spill=False)
    kv.put("a", (b"a" * 8, b""))
    assert kv.peek("prefix") == (b"p" * 8, b"") and kv.where("prefix") == "ram"  # peeking keeps it
    assert kv.put("b", (b"b" * 8, b"")) == ["a"]  # the peek made the prefix the most recently used
    assert kv.put("c", (b"c" * 8, b"")) == ["prefix"]
    assert kv.where("prefix") == "none" and kv.where("a") == "disk"  # a prefix is built again, not spilled
    assert kv.peek("a") is None  # peek never reads a session's spill file


def prompt_with_system(n_system: int, n_total: int) -> Prompt:
    spans = (Span("system", 0, n_system), Span("user", n_system, n_total))
    return Prompt(tuple(range(n_total)), spans)


def test_the_shareable_prefix_is_the_leading_system_message_when_long_enough():
    assert prefix_end(prompt_with_system(300, 400), 256) == 300
    assert prefix_end(prompt_with_system(200, 400), 256) == 0  # too short to be worth a cache entry
    assert prefix_end(prompt_with_system(400, 400), 256) == 0  # nothing follows it: no turn to start
    assert prefix_end(Prompt(tuple(range(400)), (Span("user", 0, 400),)), 1) == 0
    assert prefix_end(Prompt(tuple(range(400))), 1) == 0  # a raw prompt has no spans


def test_prefix_keys_are_the_owner_and_the_exact_tokens():
    key = PrefixCache.key
    assert key("a", [1, 2, 3]) == key("a", (1, 2, 3))
    assert len({key("a", [1, 2, 3]), key("b", [1, 2, 3]), key("a", [1, 2, 4]), key("a", [1, 2])}) == 4
    assert key("a", [1, 2, 3]).startswith("\0")  # never a session key ("owner:id")


def test_a_prefix_is_wanted_from_its_second_sighting_or_while_cached_or_building():
    cache = PrefixCache(ParkedKV(budget_bytes=100), min_tokens=4)
    assert not cache.wanted("k")  # first sighting: served as before, remembered
    assert cache.wanted("k")
    cache.begin("j")
    assert cache.wanted("j")  # being built by another turn: wait for it
    cache.finish("j", (b"t", b"s"))
    assert cache.wanted("j") and not cache.wanted("x")


def test_a_failed_build_leaves_no_entry_and_a_finished_one_is_kept():
    cache = PrefixCache(ParkedKV(budget_bytes=100), min_tokens=4)
    cache.begin("k")
    assert cache.building("k") and cache.get("k") is None
    assert cache.finish("k", None) == [] and not cache.building("k") and cache.get("k") is None
    cache.begin("k")
    cache.finish("k", (b"t", b"s"))
    assert cache.get("k") == (b"t", b"s")


async def test_admission_round_robin_and_bound():
    sched = FairAdmission(max_pending=5)
    order: list[str] = []
    gate = asyncio.Event()

    def job(name: str):
        async def run():
            if name == "first":
                await gate.wait()
            order.append(name)
            return name
        return run

    sched.start()
    first = asyncio.create_task(sched.submit("x", job("first")))
    assert await until_async(lambda: sched.running == 1, 5)  # running, held at the gate
    waits = [asyncio.create_task(sched.submit(k, job(f"{k}{i}"))) for k, i in
             [("a", 1), ("a", 2), ("a", 3), ("b", 1), ("c", 1)]]
    assert await until_async(lambda: sched.pending == 5, 5)
    with pytest.raises(QueueFull):
        await sched.submit("d", job("d1"))
    gate.set()
    await asyncio.gather(first, *waits)
    assert order == ["first", "a1", "b1", "c1", "a2", "a3"]
    await sched.stop()


async def test_side_calls_are_bounded_by_the_queue_limit_and_counted_in_depth():
    adm = FairAdmission(max_pending=2)
    async with adm.side_call(), adm.side_call():
        assert adm.depth == 2
        with pytest.raises(QueueFull, match="2 requests already wait for the model thread"):
            async with adm.side_call():
                pass
    assert adm.side_calls == 0 and adm.depth == 0
    async with adm.side_call():  # room again once the calls are done
        assert adm.side_calls == 1


async def test_admission_delivers_exceptions_and_skips_cancelled():
    sched = FairAdmission(max_pending=10)
    sched.start()

    async def boom():
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await sched.submit("a", boom)
    ran = []

    gate = asyncio.Event()

    async def slow():
        await gate.wait()
        ran.append("slow")

    async def never():
        ran.append("never")

    t1 = asyncio.create_task(sched.submit("a", slow))
    assert await until_async(lambda: sched.running == 1, 5)
    t2 = asyncio.create_task(sched.submit("b", never))
    assert await until_async(lambda: sched.pending == 1, 5)
    t2.cancel()
    gate.set()
    await t1
    assert await until_async(lambda: sched.pending == 0 and sched.running == 0, 5)  # the loop passed t2 by
    assert ran == ["slow"]
    await sched.stop()


async def test_memory_store_ttl():
    store = MemoryStore(ttl_s=1)
    await store.save("s", {"id": "s", "turns": 2})
    assert (await store.load("s"))["turns"] == 2
    store._data["s"] = (0.0, store._data["s"][1])  # expire it
    assert await store.load("s") is None
    assert not await store.delete("s")


async def test_redis_store_roundtrip_ttl_and_outage(redis_server):
    store = RedisStore(redis_server.url, ttl_s=120)
    await store.save("abc", {"id": "abc", "turns": 1})
    assert (await store.load("abc")) == {"id": "abc", "turns": 1}
    assert 0 < redis_server.client.ttl("specgate:session:abc") <= 120
    assert await store.delete("abc") and await store.load("abc") is None
    await store.close()
    dead = RedisStore("redis://127.0.0.1:1/0", ttl_s=10)
    assert not await dead.ping()
    with pytest.raises(StoreUnavailable, match="redis"):
        await dead.load("x")
    await dead.close()
