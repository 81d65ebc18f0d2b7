"""Redis outages lose no session: a Redis restarted empty, and a Redis paused past the lease
TTL, leave every session this replica holds -- resident in a slot, parked in RAM, spilled to
disk -- held, with its KV, and its lease claimed again (a lease that is simply gone is not
another replica's).  Real redis-server, real models."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import httpx
import pytest

from gateway import keys
from tests.support import RedisServer, start_gateway

LEASE = "specgate:lease:anonymous:"
WHERE = ("resident", "ram", "disk")


def log_doc(i: int) -> str:
    return " ".join(f"Log {i}.{k}: pump {k % 4} ran {k * i + 5} minutes." for k in range(24))


def chat(base: str, sid: str, messages: list[dict]) -> dict:
    r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                   json={"messages": messages, "max_tokens": 4, "specprefill": {"mass": 1.0}})
    assert r.status_code == 200, r.text
    return r.json()


def until(check: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture()
def three_places(small_model, tmp_path):
    """A gateway with one slot and room in RAM for one parked session: of three sessions, the
    last is resident, the second parked in RAM and the first spilled to disk."""
    redis = RedisServer()
    gw = start_gateway(small_model, small_model, redis_url=redis.url, lease_ms=1000, kv_budget_mb=20,
                       kv_spill_dir=str(tmp_path), engine={"slots": 1})
    history: dict[str, list[dict]] = {}
    try:
        for i, where in enumerate(reversed(WHERE)):  # disk first: it is parked, then pushed out of RAM
            sid = f"s-{where}"
            msgs = [{"role": "user", "content": log_doc(i + 1) + " Which pump ran longest?"}]
            history[sid] = [*msgs, chat(gw.base, sid, msgs)["choices"][0]["message"]]
        for where in WHERE:
            assert httpx.get(f"{gw.base}/v1/sessions/s-{where}").json()["kv"] == where
        yield redis, gw, history
    finally:
        gw.stop()
        redis.stop()


def leases(redis: RedisServer) -> set[str]:
    return {k.decode()[len(LEASE):] for k in redis.client.keys(LEASE + "*")}  # type: ignore[union-attr]


def assert_nothing_dropped(gw, redis: RedisServer, history: dict[str, list[dict]]) -> None:
    sids = set(history)
    assert until(lambda: leases(redis) >= sids), f"leases held again: {leases(redis)}"  # re-claimed, not lost
    assert gw.app[keys.MANAGER].live == len(sids)
    for where in WHERE:  # nothing was dropped: each session is where it was
        assert httpx.get(f"{gw.base}/v1/sessions/s-{where}").json()["kv"] == where
    for sid, msgs in history.items():
        t = chat(gw.base, sid, [*msgs, {"role": "user", "content": "And the shortest?"}])["timings"]
        assert not t["kv_rebuilt"] and t["cache_n"] >= len(msgs[0]["content"]) // 8, (sid, t)


def test_a_redis_restarted_empty_drops_no_session(three_places):
    redis, gw, history = three_places
    before = redis.client.info("server")["run_id"]  # type: ignore[union-attr]
    redis.stop()
    # the same address, empty (no persistence): every lease is gone.  Its emptiness is not read
    # back: the replica's renewal, once a second, may already have claimed its leases again
    back = RedisServer(port=redis.port)
    try:
        assert back.client.info("server")["run_id"] != before  # type: ignore[union-attr]
        assert_nothing_dropped(gw, back, history)
    finally:
        back.stop()


def test_a_redis_paused_past_the_lease_drops_no_session(three_places):
    redis, gw, history = three_places
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        time.sleep(2.5)  # the outage itself: longer than the 1 s lease, so every lease expires
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    assert_nothing_dropped(gw, redis, history)
