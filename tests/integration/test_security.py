"""Security regressions, in the spirit of llama.cpp's server test of the same name: API keys,
session isolation between keys, refused ids, bounded input and session-state integrity,
through the real gateway (tiny models, a real redis-server) and real HTTP/WS clients."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import orjson
import pytest

from core.config import Limits
from gateway import keys
from tests.support import ModelThreadHeld, start_gateway, until

pytestmark = [pytest.mark.models, pytest.mark.redis]
ALICE, BOB = {"Authorization": "Bearer sk-alice"}, {"Authorization": "Bearer sk-bob"}
ONE = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def spill_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("spill")


@pytest.fixture(scope="module")
def gw(tiny_target, tiny_speculator, redis_server, spill_dir):
    server = start_gateway(tiny_target, tiny_speculator, redis_url=redis_server.url, api_keys=("sk-alice", "sk-bob"),
                           kv_budget_mb=0, kv_spill_dir=str(spill_dir), max_queue=3, engine={"slots": 1},
                           stream_hold_s=0,  # streams open at once: tests act while their turn runs
                           limits=Limits(max_messages=64, max_sessions_per_key=12, max_tokens_cap=512))
    yield server
    server.stop()


def chat(gw, headers, session=None, messages=ONE, **extra) -> httpx.Response:
    h = {**headers, **({"X-SpecGate-Session": session} if session else {})}
    return httpx.post(gw.base + "/v1/chat/completions", headers=h, timeout=120,
                      json={"messages": messages, "max_tokens": 4, **extra})


def code(resp: httpx.Response) -> tuple[int, str]:
    return resp.status_code, resp.json()["error"]["code"]


def stored(redis_server, gw, owner_header, sid):
    gw.call(gw.app[keys.MANAGER].writer.flush(5))
    owner = gw.app[keys.API_KEYS].owner(owner_header["Authorization"])
    raw = redis_server.client.get(f"specgate:session:{owner}:{sid}")
    return None if raw is None else orjson.loads(raw)


def test_missing_or_wrong_key_gets_401_and_probes_stay_open(gw):
    for headers in ({}, {"Authorization": "Bearer sk-mallory"}, {"Authorization": "sk-alice"}):
        r = chat(gw, headers)
        assert code(r) == (401, "invalid_api_key") and r.headers["WWW-Authenticate"].startswith("Bearer")
        assert httpx.get(gw.base + "/v1/models", headers=headers).status_code == 401
        assert httpx.post(gw.base + "/v1/sessions", headers=headers, json={}).status_code == 401
    for path in ("/health", "/ready", "/metrics", "/openapi.json"):
        assert httpx.get(gw.base + path).status_code == 200, path
    assert chat(gw, ALICE).status_code == 200


def test_another_keys_session_looks_exactly_unknown(gw, redis_server):
    r = chat(gw, ALICE, "shared-name", [{"role": "user", "content": "The vault code is 1234."}])
    assert r.status_code == 200
    unknown = httpx.get(gw.base + "/v1/sessions/never-made", headers=BOB)
    theirs = httpx.get(gw.base + "/v1/sessions/shared-name", headers=BOB)
    assert theirs.status_code == unknown.status_code == 404
    assert theirs.json()["error"]["message"].replace("shared-name", "X") == \
        unknown.json()["error"]["message"].replace("never-made", "X")
    assert httpx.delete(gw.base + "/v1/sessions/shared-name", headers=BOB).status_code == 404
    # the same name under Bob's key is Bob's own, fresh session: nothing of Alice's is reused
    mine = chat(gw, BOB, "shared-name", [{"role": "user", "content": "The vault code is 1234."}])
    assert mine.status_code == 200 and mine.json()["timings"]["cache_n"] == 0
    assert httpx.post(gw.base + "/v1/sessions", headers=BOB, json={"id": "other-alice"}).status_code == 201
    assert stored(redis_server, gw, ALICE, "shared-name")["turns"] == 1  # untouched by Bob
    assert httpx.get(gw.base + "/v1/sessions/shared-name", headers=ALICE).json()["turns"] == 1

    async def ws_as_bob() -> int:
        async with aiohttp.ClientSession() as http:
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await http.ws_connect(f"{gw.base}/v1/sessions/shared-name-x/ws", headers=BOB)
            async with http.ws_connect(f"{gw.base}/v1/sessions/shared-name/ws", headers=BOB) as ws:
                await ws.send_json({"type": "turn", "messages": [{"role": "user", "content": "Code?"}],
                                    "max_tokens": 2})
                while (event := await ws.receive_json())["type"] == "delta":
                    pass
                assert event["type"] == "done"
            with pytest.raises(aiohttp.WSServerHandshakeError) as nokey:
                await http.ws_connect(f"{gw.base}/v1/sessions/shared-name/ws")
            assert nokey.value.status == 401
            return info.value.status

    assert asyncio.run(ws_as_bob()) == 404
    assert stored(redis_server, gw, ALICE, "shared-name")["turns"] == 1


def test_path_traversal_and_odd_ids_are_refused(gw, spill_dir, tmp_path):
    bait = tmp_path / "x.kv"
    bait.write_text("keep me")
    rel = "..%2F" * 12 + str(bait.with_suffix("")).lstrip("/").replace("/", "%2F")
    for sid in (rel, "..%2F", "%D9%A3%D9%A3", "a" * 65, "a%20b"):
        r = httpx.delete(f"{gw.base}/v1/sessions/{sid}", headers=ALICE)
        assert code(r) == (400, "invalid_request"), sid
        assert httpx.get(f"{gw.base}/v1/sessions/{sid}", headers=ALICE).status_code == 400
    assert code(chat(gw, ALICE, "../../etc/passwd"))[0] == 400
    assert bait.read_text() == "keep me"
    own = gw.app[keys.MANAGER].parked.spill_dir  # the replica's own folder under the spill directory
    assert own.parent == spill_dir and all(p.parent == own for p in own.rglob("*"))
    assert [p for p in spill_dir.iterdir()] == [own]


@pytest.mark.parametrize("extra, status", [
    ({"specprefill": {"lookahead": 1.5}}, 400),  # was a 500 that reset the session's KV
    ({"specprefill": {"lookahead": 10**6}}, 400),  # was ~21 GB of captured rows
    ({"specprefill": {"break_even": False}}, 400),
    ({"n": True}, 400),
    ({"max_tokens": 0}, 400),  # 100_000 is clamped to the cap now, never refused
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "x"}]}, 400),  # was a 500
    ({"messages": ONE * 65}, 413),
    ({"messages": [{"role": "user", "content": "w" * 270_000}]}, 413),  # 16 chars a token of the 4x limit
    ({"messages": [{"role": "user", "content": "w" * 70_000}]}, 400),  # past the window, none of it may go
])
def test_bad_fields_get_4xx_and_leave_the_session_intact(gw, extra, status):
    sid = f"intact-{abs(hash(str(extra))) % 10**8}"
    first = chat(gw, ALICE, sid, [{"role": "user", "content": "Remember 42. " * 20}])
    assert first.status_code == 200
    bad = chat(gw, ALICE, sid, **{"messages": [{"role": "user", "content": "Remember 42. " * 20}], **extra})
    assert bad.status_code == status, bad.text
    again = chat(gw, ALICE, sid, [{"role": "user", "content": "Remember 42. " * 20}])
    assert again.json()["timings"]["cache_n"] > 0  # the session's KV survived the bad request
    httpx.delete(f"{gw.base}/v1/sessions/{sid}", headers=ALICE)


def test_a_flood_of_tiny_messages_is_refused_before_the_model_thread():
    from core.errors import RequestTooLarge
    from core.policies import TurnParams
    from gateway import chat_request as protocol

    body = {"messages": [{"role": "user", "content": "x"}] * 20_000}
    t0 = time.perf_counter()
    with pytest.raises(RequestTooLarge, match="max_messages"):
        protocol.parse_chat(body, TurnParams(), None)
    assert time.perf_counter() - t0 < 1.0  # refused on parsing, never rendered


def test_tool_schemas_nested_1000_deep_get_413(gw):
    def body(n: int) -> bytes:  # written by hand: no JSON encoder nests this deep
        deep = '{"type":"object","properties":{"x":' * n + '{"type":"string"}' + "}}" * n
        return ('{"messages":[{"role":"user","content":"x"}],"tools":[{"type":"function","function":'
                '{"name":"f","parameters":' + deep + "}}]}").encode()

    as_json = {**ALICE, "Content-Type": "application/json"}
    r = httpx.post(gw.base + "/v1/chat/completions", headers=as_json, content=body(400))
    assert code(r) == (413, "request_too_large") and "max_tool_depth" in r.json()["error"]["message"]
    r = httpx.post(gw.base + "/v1/chat/completions", headers=as_json, content=body(1000))  # 2000 levels
    assert code(r) == (400, "invalid_request") and "malformed JSON" in r.json()["error"]["message"]


def test_megabytes_of_tools_get_413_without_the_model_thread(gw):
    """Tool definitions render into the prompt too: 12 MB of them (a body under the 16 MB
    cap) count toward ``max_prompt_chars`` and are refused while parsing, with the model
    thread busy elsewhere the whole time (it never renders them)."""
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 4000,
                                             "parameters": {"type": "object", "properties": {}}}}
    body = {"messages": ONE, "tools": [dict(tool, function={**tool["function"], "name": f"f{i}"})
                                       for i in range(3100)]}
    assert len(orjson.dumps(body)) > 12 << 20
    with ModelThreadHeld(gw):
        r = httpx.post(gw.base + "/v1/chat/completions", headers=ALICE, json=body, timeout=30)
    assert code(r) == (413, "request_too_large")
    assert "messages and tools hold" in r.json()["error"]["message"] and "max_prompt_chars" in r.text


def test_only_known_message_fields_are_stored(gw, redis_server):
    msgs = [{"role": "user", "content": "Hello.", "evil": "x" * 1000, "name": "u1"}]
    assert chat(gw, ALICE, "fields-1", msgs).status_code == 200
    history = stored(redis_server, gw, ALICE, "fields-1")["history"]
    assert history[0] == {"role": "user", "content": "Hello.", "name": "u1"}


def test_session_cap_per_key_answers_429(gw):
    made = []
    try:
        for i in range(40):
            r = httpx.post(gw.base + "/v1/sessions", headers=BOB, json={"id": f"cap-{i}"})
            if r.status_code != 201:
                break
            made.append(f"cap-{i}")
        assert code(r) == (429, "too_many_sessions") and "12" in r.json()["error"]["message"]
        assert len(made) < 12 and httpx.post(gw.base + "/v1/sessions", headers=ALICE, json={}).status_code == 201
    finally:
        for sid in made:
            httpx.delete(f"{gw.base}/v1/sessions/{sid}", headers=BOB)


def _stream(gw, sid, max_tokens=400, long=False):
    """``long``: a ~2.5K-token prompt whose dense prefill keeps the turn busy for seconds after
    its stream started (a stream starts once its prompt is rendered on the model thread)."""
    text = "Count to a thousand." + (" The pump log lists flow, pressure and temperature." * 230 if long else "")
    return httpx.stream("POST", gw.base + "/v1/chat/completions", headers={**ALICE, "X-SpecGate-Session": sid},
                        timeout=120, json={"messages": [{"role": "user", "content": text}],
                                           "max_tokens": max_tokens, "stream": True, "specprefill": False})


def test_a_second_concurrent_turn_on_a_session_gets_409(gw):
    with _stream(gw, "busy-1", long=True) as resp:  # its turn prefills for seconds: hold the thread meanwhile
        assert resp.status_code == 200
        with ModelThreadHeld(gw):
            assert code(chat(gw, ALICE, "busy-1")) == (409, "session_busy")  # refused with the thread held
    for _ in range(100):  # the left stream is cancelled; the session frees up
        if (r := chat(gw, ALICE, "busy-1")).status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200


def test_delete_during_a_running_turn_wins(gw, redis_server):
    with _stream(gw, "doomed-1", long=True) as resp:
        lines = resp.iter_lines()
        with ModelThreadHeld(gw) as held:
            assert httpx.delete(gw.base + "/v1/sessions/doomed-1", headers=ALICE).status_code == 200
            held.release.set()
            events = [line for line in lines if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and '"code":"cancelled"' in events[-2]
    assert httpx.get(gw.base + "/v1/sessions/doomed-1", headers=ALICE).status_code == 404
    assert stored(redis_server, gw, ALICE, "doomed-1") is None


def test_a_full_queue_refuses_streams_with_a_real_429(gw):
    streams = [_stream(gw, f"q-{i}", max_tokens=200) for i in range(6)]
    statuses = []
    opened = []
    try:
        for s in streams:
            resp = s.__enter__()
            opened.append(s)
            statuses.append(resp.status_code)
            if resp.status_code == 429:
                assert resp.headers["Retry-After"] == "2"
                break
        assert 429 in statuses
    finally:
        for s in opened:
            s.__exit__(None, None, None)


def test_a_flood_of_token_counts_is_refused_past_the_bound_not_queued_ahead_of_turns(gw):
    """Counting tokens runs on the model thread: past ``max_queue`` (3) waiting calls, the rest
    get a 429 at once rather than queueing ahead of every stream's next step."""
    import concurrent.futures

    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "pump log " * 5000}]}
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        with ModelThreadHeld(gw):  # every admitted count waits for the model thread meanwhile
            futures = [pool.submit(httpx.post, gw.base + "/v1/messages/count_tokens", headers=ALICE, json=body,
                                   timeout=120) for _ in range(8)]
            deadline = time.monotonic() + 60
            while sum(f.done() for f in futures) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            early = [f for f in futures if f.done()]
        refused = [f.result() for f in early]
        counted = [f.result(60) for f in futures if f not in early]
    assert len(refused) == 5 and {code(r) for r in refused} == {(429, "queue_full")}
    assert [r.status_code for r in counted] == [200] * 3 and len({r.json()["input_tokens"] for r in counted}) == 1


def test_a_flood_of_token_counts_gets_one_call_per_step_and_the_stream_keeps_moving(gw):
    """Two clients that send a new count as soon as one returns: the model thread runs the
    calls queued when a step begins, not every call that keeps arriving, so a stream beside
    them keeps getting its tokens (the step loop counts its steps)."""
    import concurrent.futures
    import threading

    stop, served = threading.Event(), [0, 0]
    body = {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "pump log " * 2000}]}

    def flood(i: int) -> None:
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                if http.post(gw.base + "/v1/messages/count_tokens", headers=ALICE, json=body).status_code == 200:
                    served[i] += 1

    stats = gw.app[keys.MANAGER].worker.stats
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        flooders = [pool.submit(flood, i) for i in range(2)]
        assert until(lambda: sum(served) >= 20)  # the flood is on
        steps0, calls0 = stats.steps, sum(served)
        reply = chat(gw, ALICE, messages=[{"role": "user", "content": "Count to a hundred."}], max_tokens=64)
        steps, calls = stats.steps - steps0, sum(served) - calls0
        stop.set()
        for f in flooders:
            f.result(60)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 64
    assert calls <= 3 * steps + 10, (calls, steps)  # about one per flooder per step, never the whole thread


def test_metrics_are_typed_and_count_rejections(gw):
    text = httpx.get(gw.base + "/metrics").text
    assert "# TYPE specgate_kv_evictions_total counter" in text
    assert "# TYPE specgate_live_sessions gauge" in text
    assert "# TYPE specgate_spill_rejected_total counter" in text
    assert 'specgate_turns_total{outcome="completed"}' in text
    assert 'specgate_rejected_total{code="invalid_api_key"}' in text


def test_idle_sessions_expire_from_memory_and_disk(tiny_target, tiny_speculator, tmp_path):
    gw = start_gateway(tiny_target, tiny_speculator, session_ttl_s=600, kv_budget_mb=0, kv_spill_dir=str(tmp_path),
                       engine={"slots": 1})
    manager = gw.app[keys.MANAGER]

    async def sweep(later_s: float) -> int:  # on the gateway's loop, as its sweeper task runs it
        return manager.sweep(time.time() + later_s)

    try:
        for sid in ("old-1", "old-2"):
            assert chat(gw, {}, sid).status_code == 200  # the second parks (spills) the first
        assert list(tmp_path.rglob("*.kv")) and manager.live == 2
        assert gw.call(sweep(60)) == 0 and manager.live == 2  # not idle long enough
        assert gw.call(sweep(601)) == 2
        deadline = time.monotonic() + 30  # the spill file goes in a job on the model thread
        while list(tmp_path.rglob("*.kv")) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert manager.live == 0 and not list(tmp_path.rglob("*.kv"))
    finally:
        gw.stop()
