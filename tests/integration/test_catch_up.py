"""Idle time keeps the scorer in step: after a turn that deferred its scorer (SpecPrefill
off, or skipped), the model thread prefills the scorer's missing tokens in chunks while no
turn runs, so the session's next turn scores only its new tokens; a turn that arrives
mid catch-up waits for one chunk at most.  Tiny pair, a real gateway."""

from __future__ import annotations

import threading

import httpx

from gateway import keys
from tests.support import start_gateway, until

LOG = " ".join(f"Unit {i % 9} reported flow {i * 7 % 113} and pressure {i * 3 % 41} at minute {i}." for i in range(140))


def chat(base: str, sid: str, messages: list[dict], **extra) -> dict:
    r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                   json={"messages": messages, "max_tokens": 4, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_idle_time_catches_the_scorer_up_and_a_turn_waits_one_chunk_at_most(tiny_target, tiny_speculator):
    gw = start_gateway(tiny_target, tiny_speculator, engine={"slots": 2}, catch_up_tokens=32)
    manager = gw.app[keys.MANAGER]
    try:
        msgs = [{"role": "user", "content": LOG + " Which unit reported the highest flow?"}]
        first = chat(gw.base, "cu-a", msgs, specprefill=False)  # the scorer is left behind
        t1 = first["timings"]
        backlog = t1["context_n"]
        assert t1["speculator_cache_n"] == 0 and t1["speculator_prefill_n"] == 0 and backlog > 2000
        assert until(lambda: manager.residency.caught_up > 0, 30)  # catch-up has begun ...
        other = threading.Thread(target=chat, args=(gw.base, "cu-b", [{"role": "user", "content": "Hello."}]))
        other.start()  # ... and a turn arrives in the middle of it
        other.join()
        assert manager.residency.caught_up < backlog  # it really arrived mid catch-up
        assert manager.worker.stats.max_idle_chunks_ahead <= 1  # it waited for one chunk at most
        assert until(lambda: manager.residency.caught_up >= backlog, 60)  # then the rest is caught up
        msgs += [first["choices"][0]["message"], {"role": "user", "content": "And the lowest?"}]
        t2 = chat(gw.base, "cu-a", msgs)["timings"]
        assert t2["speculator_cache_n"] >= backlog  # the scorer holds the whole first turn
        assert t2["speculator_prefill_n"] <= t2["context_n"] - backlog  # only the new tokens
    finally:
        gw.stop()
