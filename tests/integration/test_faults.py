"""Faults against real processes: a paused and a killed Redis, SIGTERM during a streamed
turn, a restart that resumes every session, a damaged spill file and an unwritable spill
directory.  Each checks that no history and no session is lost."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aiohttp
import httpx
import orjson

from gateway import keys
from tests.support import RedisServer, ServerProcess, start_gateway, until

STORY = [{"role": "user", "content": "Count from 1 to 400, separated by spaces."}]


def record(redis: RedisServer, sid: str) -> dict | None:
    raw = redis.client.get(f"specgate:session:anonymous:{sid}")
    return None if raw is None else orjson.loads(raw)


def server_ms(srv: ServerProcess, request_id: str) -> float:
    """The server's own time for one request, from its ``request_end`` log line."""
    def line() -> dict | None:
        for raw in Path(srv.log.name).read_bytes().splitlines():  # its own handle: the child shares srv.log's offset
            if request_id.encode() in raw and b'"request_end"' in raw:
                return orjson.loads(raw)
        return None
    assert until(lambda: line() is not None, 10), f"no request_end logged for {request_id}"
    return float(line()["ms"])  # type: ignore[index]


def chat(base: str, sid: str | None, messages, **extra) -> httpx.Response:
    headers = {"X-SpecGate-Session": sid} if sid else {}
    return httpx.post(base + "/v1/chat/completions", headers=headers, timeout=120,
                      json={"messages": messages, "max_tokens": 6, **extra})


async def ws_turn(base: str, sid: str, text: str) -> dict:
    async with aiohttp.ClientSession() as http, http.ws_connect(f"{base}/v1/sessions/{sid}/ws") as ws:
        await ws.send_json({"type": "turn", "messages": [{"role": "user", "content": text}], "max_tokens": 6})
        while (event := await ws.receive_json())["type"] == "delta":
            pass
        return event


def test_sigterm_drains_a_streamed_turn_and_a_restart_resumes_every_session(small_model):
    redis = RedisServer()
    srv = ServerProcess(small_model, small_model, "--redis-url", redis.url, "--drain-timeout-s", "300")
    try:
        first = chat(srv.base, "http-1", [{"role": "user", "content": "My name is Ada."}]).json()
        http_history = [{"role": "user", "content": "My name is Ada."}, first["choices"][0]["message"]]
        assert httpx.post(srv.base + "/v1/sessions", json={"id": "ws-1"}).status_code == 201
        assert asyncio.run(ws_turn(srv.base, "ws-1", "My cat is called Tom."))["type"] == "done"
        with httpx.stream("POST", srv.base + "/v1/chat/completions", headers={"X-SpecGate-Session": "long-1"},
                          timeout=600, json={"messages": STORY, "max_tokens": 120, "stream": True}) as resp:
            lines = resp.iter_lines()
            next(line for line in lines if '"content"' in line and '"role"' not in line)
            srv.signal(signal.SIGTERM)
            assert until(lambda: httpx.get(srv.base + "/ready").status_code == 503)  # draining: balancers move away
            refused = chat(srv.base, None, [{"role": "user", "content": "hi"}])
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest)  # finished, not cut
        assert srv.wait(90) == 0
        assert record(redis, "long-1")["turns"] == 1  # flushed before exit

        srv = ServerProcess(small_model, small_model, "--redis-url", redis.url)
        again = chat(srv.base, "http-1", [*http_history, {"role": "user", "content": "What is my name?"}]).json()
        assert again["timings"]["kv_rebuilt"] is True and again["timings"]["cache_n"] == 0
        done = asyncio.run(ws_turn(srv.base, "ws-1", "What is my cat called?"))
        assert done["type"] == "done" and done["timings"]["kv_rebuilt"] is True
        # the record lands just after the reply (the store writer is asynchronous)
        assert until(lambda: len(record(redis, "ws-1")["history"]) >= 4)
        ws_history = record(redis, "ws-1")["history"]
        assert [m["content"] for m in ws_history if m["role"] == "user"] == [
            "My cat is called Tom.", "What is my cat called?"]  # the history survived the restart
        assert done["usage"]["prompt_tokens"] > 20  # the prompt was rebuilt from it, not just the new message
    finally:
        srv.stop()
        redis.stop()


def test_a_paused_redis_neither_fails_nor_stalls_turns_and_the_store_converges(tiny_target, tiny_speculator):
    redis = RedisServer()
    srv = ServerProcess(tiny_target, tiny_speculator, "--redis-url", redis.url)

    def three_turns(msgs: list[dict]) -> tuple[list[dict], list[float]]:
        took = []
        for i in range(3):
            msgs = [*msgs, {"role": "assistant", "content": "ok"}, {"role": "user", "content": f"Turn {i}."}]
            reply = chat(srv.base, "p-1", msgs, stream=False)
            assert reply.status_code == 200
            took.append(server_ms(srv, reply.headers["X-Request-Id"]))
        return msgs, took

    try:
        msgs, _ = three_turns([{"role": "user", "content": "Hello."}])
        os.kill(redis.proc.pid, signal.SIGSTOP)
        try:
            msgs, paused = three_turns(msgs)
            ready = httpx.get(srv.base + "/ready", timeout=5).json()
            assert ready["ready"] and ready["degraded"]
            metrics = httpx.get(srv.base + "/metrics", timeout=5).text
            assert "specgate_store_pending_writes 1.0" in metrics  # the replies went out; the record waits
        finally:
            os.kill(redis.proc.pid, signal.SIGCONT)
        # one Redis call awaited on the reply path costs the store's timeout twice (0.5 s, one
        # retry) against a paused Redis; a six-token turn on tiny models takes ~0.1 s.  The server's
        # own time for each request (its request_end log line) is the measure: no client overhead.
        assert max(paused) < 1000, f"server ms of the turns with Redis paused: {paused}"
        assert until(lambda: (rec := record(redis, "p-1")) is not None and rec["turns"] == 6, 15)
        rec = record(redis, "p-1")
        assert rec is not None and len(rec["history"]) == len(msgs) + 1
    finally:
        srv.stop()
        redis.stop()


def test_a_damaged_spill_file_rebuilds_and_an_unwritable_spill_dir_fails_nobody(small_model, tmp_path):
    spill = tmp_path / "spill"
    gw = start_gateway(small_model, small_model, kv_budget_mb=0, kv_spill_dir=str(spill), engine={"slots": 1})
    try:
        a = [{"role": "user", "content": "Pump 3 ran 40 minutes. Which pump?"}]
        keep = {"specprefill": {"mass": 1.0}}
        first = chat(gw.base, "a", a, **keep).json()
        chat(gw.base, "b", [{"role": "user", "content": "Other."}], **keep)  # parks a: spilled (budget 0)
        own = gw.app[keys.MANAGER].parked.spill_dir  # this replica's folder under the spill directory
        assert own is not None and own.parent == spill
        (path,) = own.glob("*.kv")
        path.write_bytes(path.read_bytes()[:-100])  # truncated
        a2 = [*a, first["choices"][0]["message"], {"role": "user", "content": "How long?"}]
        second = chat(gw.base, "a", a2, **keep).json()
        assert second["timings"]["kv_rebuilt"] is True and second["timings"]["cache_n"] == 0
        fresh = chat(gw.base, None, a2, **keep).json()
        assert second["choices"][0]["message"] == fresh["choices"][0]["message"]  # nothing silently lost
        assert "specgate_spill_rejected_total 1.0" in httpx.get(gw.base + "/metrics").text

        for p in own.iterdir():
            p.unlink()
        own.rmdir()
        own.write_text("not a directory")  # every spill write now fails
        assert chat(gw.base, "b", [{"role": "user", "content": "Other."}, {"role": "assistant", "content": "x"},
                                   {"role": "user", "content": "More."}], **keep).status_code == 200
        third = chat(gw.base, "a", [*a2, second["choices"][0]["message"], {"role": "user", "content": "Ok."}],
                     **keep)  # parks b: its spill fails
        assert third.status_code == 200 and third.json()["timings"]["kv_rebuilt"] is True
        assert gw.app[keys.MANAGER].parked.spill_failures >= 1
        fourth = chat(gw.base, "b", [{"role": "user", "content": "Other."}], **keep)
        assert fourth.status_code == 200 and fourth.json()["timings"]["kv_rebuilt"] is True
    finally:
        gw.stop()
