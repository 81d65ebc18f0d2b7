"""The gateway over real HTTP: the official openai client, raw httpx, a real redis-server."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from gateway import keys
from tests.support import ModelThreadHeld, until

DOC = " ".join(f"Entry {k}: valve {k % 6} pressure {k * 7 + 2} kPa." for k in range(40))


def client(gw, **kw) -> openai.OpenAI:
    return openai.OpenAI(base_url=gw.base + "/v1", api_key="unused", max_retries=0, **kw)


def new_session(gw) -> str:
    r = httpx.post(gw.base + "/v1/sessions", json={})
    assert r.status_code == 201
    return r.json()["id"]


def test_plain_completion_with_timings_and_usage(gateway):
    resp = client(gateway).chat.completions.create(
        model="specgate", messages=[{"role": "user", "content": DOC + " Which valve?"}], max_tokens=4)
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage.completion_tokens == 4 and resp.usage.prompt_tokens > 300
    t = resp.model_extra["timings"]
    for key in ("specprefill", "prompt_n", "cache_n", "speculator_prefill_n", "speculator_cache_n", "scoring_ms",
                "prompt_ms", "ttft_ms", "predicted_n", "predicted_ms"):
        assert key in t, key
    assert t["specprefill"] == "active" and t["prompt_n"] < t["context_n"] == resp.usage.prompt_tokens
    assert resp.usage.prompt_tokens_details.cached_tokens == 0


def test_streamed_completion_ends_with_timings_usage_and_done(gateway):
    stream = client(gateway).chat.completions.create(
        model="specgate", messages=[{"role": "user", "content": "Say hi. " * 5}], max_tokens=6, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["timings"]["predicted_n"] == 6
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    plain = client(gateway).chat.completions.create(
        model="specgate", messages=[{"role": "user", "content": "Say hi. " * 5}], max_tokens=6)
    assert text == plain.choices[0].message.content
    raw = httpx.post(gateway.base + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}).text
    assert raw.rstrip().endswith("data: [DONE]")


def test_session_turns_prefill_only_the_delta_and_mirror_to_redis(gateway, redis_server):
    sid = new_session(gateway)
    c = client(gateway, default_headers={"X-SpecGate-Session": sid})
    msgs = [{"role": "system", "content": "You read logs."}, {"role": "user", "content": DOC + " Valve 3?"}]
    r1 = c.chat.completions.create(model="specgate", messages=msgs, max_tokens=5)
    t1 = r1.model_extra["timings"]
    assert t1["speculator_cache_n"] == 0 and t1["cache_n"] == 0 and t1["speculator_prefill_n"] == t1["context_n"]
    msgs += [{"role": "assistant", "content": r1.choices[0].message.content},
             {"role": "user", "content": DOC[:120] + " And valve 4?"}]
    # a short delta: re-prefilling the sparse target's cells into the speculator (a mirror) never repays
    r2 = c.chat.completions.create(model="specgate", messages=msgs, max_tokens=5)
    t2 = r2.model_extra["timings"]
    assert t2["speculator_cache_n"] >= t1["context_n"] and t2["cache_n"] >= t1["context_n"]
    assert t2["speculator_prefill_n"] == t2["context_n"] - t2["speculator_cache_n"]
    assert t2["speculator_prefill_n"] < t2["context_n"] - t1["context_n"] + 20
    assert r2.usage.prompt_tokens_details.cached_tokens == t2["cache_n"]
    stored = json.loads(redis_server.client.get(f"specgate:session:anonymous:{sid}"))
    assert stored["turns"] == 2 and stored["last_status"] == t2["specprefill"]
    assert stored["history"] == [*msgs, {"role": "assistant", "content": r2.choices[0].message.content}]
    assert stored["prompt_tokens"] == t1["context_n"] + t2["context_n"]
    assert 0 < redis_server.client.ttl(f"specgate:session:anonymous:{sid}") <= 86400
    view = httpx.get(f"{gateway.base}/v1/sessions/{sid}").json()
    assert view["turns"] == 2 and view["kv"] == "resident" and view["store"] == "redis"
    assert httpx.delete(f"{gateway.base}/v1/sessions/{sid}").status_code == 200
    gateway.call(gateway.app[keys.MANAGER].writer.flush(5))
    assert redis_server.client.get(f"specgate:session:anonymous:{sid}") is None
    assert httpx.get(f"{gateway.base}/v1/sessions/{sid}").status_code == 404


def test_an_unknown_session_id_is_created_on_first_use(gateway):
    """A client that has only the openai SDK names its session in a header and never calls
    POST /v1/sessions; with auto-creation off, the same request is a 404."""
    sid = "agent-run-7"
    c = client(gateway, default_headers={"X-SpecGate-Session": sid})
    msgs = [{"role": "user", "content": DOC + " Valve 3?"}]
    first = c.chat.completions.create(model="specgate", messages=msgs, max_tokens=3)
    assert first.model_extra["session_id"] == sid and first.model_extra["timings"]["cache_n"] == 0
    msgs += [{"role": "assistant", "content": first.choices[0].message.content},
             {"role": "user", "content": "And valve 4?"}]
    second = c.chat.completions.create(model="specgate", messages=msgs, max_tokens=3)
    assert second.model_extra["timings"]["cache_n"] >= first.model_extra["timings"]["context_n"]
    assert httpx.get(f"{gateway.base}/v1/sessions/{sid}").json()["turns"] == 2
    runner = gateway.app[keys.RUNNER]
    runner.auto_create = False
    try:
        status, code, _ = error_of(httpx.post(gateway.base + "/v1/chat/completions",
                                              headers={"X-SpecGate-Session": "nope"},
                                              json={"messages": [{"role": "user", "content": "x"}]}))
        assert (status, code) == (404, "session_not_found")
    finally:
        runner.auto_create = True
    assert httpx.delete(f"{gateway.base}/v1/sessions/{sid}").status_code == 200


def error_of(resp: httpx.Response) -> tuple[int, str, str]:
    body = resp.json()["error"]
    return resp.status_code, body["code"], body["message"]


def test_bad_input_gets_precise_errors(gateway):
    url = gateway.base + "/v1/chat/completions"
    as_json = {"Content-Type": "application/json"}
    assert error_of(httpx.post(url, content=b"{not json", headers=as_json))[:2] == (400, "invalid_request")
    assert error_of(httpx.post(url, content=b""))[:2] == (400, "invalid_request")
    status, code, msg = error_of(httpx.post(url, json={"messages": [{"role": "user", "content": "x"}],
                                                       "temperature": -1}))
    assert (status, code) == (400, "invalid_parameter") and "temperature" in msg
    status, code, msg = error_of(httpx.post(url, json={"messages": [{"role": "wizard", "content": "x"}]}))
    assert status == 400 and "role" in msg
    status, code, msg = error_of(httpx.post(url, headers={"X-SpecGate-Session": "../../tmp/x"},
                                            json={"messages": [{"role": "user", "content": "x"}]}))
    assert (status, code) == (400, "invalid_request") and "session id" in msg
    status, code, msg = error_of(httpx.post(url, json={"messages": [{"role": "user", "content": "word " * 5000}]}))
    assert (status, code) == (400, "context_length_exceeded") and "4095" in msg  # one message: none of it can go
    status, code, msg = error_of(httpx.post(url, json={"messages": [{"role": "user", "content": "word " * 17000}]}))
    assert (status, code) == (400, "context_length_exceeded") and "17" in msg and "16384" in msg  # past the limit
    with pytest.raises(openai.BadRequestError):
        client(gateway).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], n=2)
    one = [{"role": "user", "content": "x"}]
    for bad, words in (({"specattn": {"p": 1.5}}, "specattn_p"), ({"specattn": "yes"}, "boolean or an object"),
                       ({"speculative": {"gamma": "4"}}, "gamma"), ({"specattn": {"gamma": 99}}, "gamma"),
                       ({"speculative": {"p": 0.9}}, "unknown speculative field")):
        status, code, msg = error_of(httpx.post(url, json={"messages": one, **bad}))
        assert status == 400 and words in msg, (bad, msg)
    assert httpx.get(gateway.base + "/v1/nope").status_code == 404


def test_over_long_prompt_leaves_the_session_intact(gateway):
    sid = new_session(gateway)
    c = client(gateway, default_headers={"X-SpecGate-Session": sid})
    msgs = [{"role": "user", "content": "Remember: the key is 42."}]
    c.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        c.chat.completions.create(model="m", messages=msgs + [{"role": "user", "content": "w " * 5000}])
    ok = c.chat.completions.create(model="m", messages=msgs, max_tokens=2)
    assert ok.model_extra["timings"]["cache_n"] > 0


def test_disconnect_mid_stream_cancels_and_others_keep_working(gateway):
    sid = new_session(gateway)
    with httpx.stream("POST", gateway.base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid},
                      json={"messages": [{"role": "user", "content": "Count to a thousand."}],
                            "max_tokens": 400, "stream": True}) as resp:
        for line in resp.iter_lines():
            if '"content"' in line and '"role"' not in line:
                break  # leave after the first real token
    # the client left: its turn is cancelled and the session is free again, not stuck running
    assert until(lambda: httpx.get(f"{gateway.base}/v1/sessions/{sid}").json()["state"] == "idle")
    other = client(gateway).chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=2)
    assert other.usage.completion_tokens == 2
    view = httpx.get(f"{gateway.base}/v1/sessions/{sid}").json()
    assert view["turns"] == 1 and view["completion_tokens"] < 400  # generation stopped early
    again = client(gateway, default_headers={"X-SpecGate-Session": sid}).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Count to a thousand."}], max_tokens=2)
    assert again.model_extra["timings"]["cache_n"] > 0


def test_full_queue_answers_429_with_retry_after(gateway):
    """max_queue 4: with the model thread held, four requests wait for it (their prompts are
    rendered there) and the rest are refused at once; then the four are served."""
    body = {"messages": [{"role": "user", "content": "Write a long story."}], "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        with ModelThreadHeld(gateway):
            futures = [pool.submit(httpx.post, gateway.base + "/v1/chat/completions", timeout=120, json=body)
                       for _ in range(6)]
            assert until(lambda: sum(f.done() for f in futures) == 2)
            limited = [f.result() for f in futures if f.done()]
        served = [f.result(60) for f in futures if f.result(60) not in limited]
    assert [r.status_code for r in limited] == [429, 429] and [r.status_code for r in served] == [200] * 4
    assert limited[0].headers["Retry-After"] == "2" and limited[0].json()["error"]["code"] == "queue_full"


def test_models_health_ready_metrics(gateway):
    model = httpx.get(gateway.base + "/v1/models").json()["data"][0]
    assert model["id"] == "specgate" and "/" not in model["target"] + model["speculator"]  # no file paths
    # clients size by the longest prompt a turn may send: 4x the tests' n_ctx, past which sessions evict
    assert model["context_length"] == model["max_model_len"] == model["context_window"] == 4 * 4096
    assert model["kv_window"] == 4096
    assert model["max_output_tokens"] == 4096  # the cap (32768) is clamped to the window
    assert httpx.get(gateway.base + "/health").json() == {"status": "ok"}
    ready = httpx.get(gateway.base + "/ready").json()
    assert ready["ready"] and ready["store"] == "redis" and ready["models"] == "ready"
    text = httpx.get(gateway.base + "/metrics").text
    for name in ("specgate_requests_total", "specgate_ttft_seconds_bucket", "specgate_specprefill_total",
                 "specgate_target_prefill_tokens_total", "specgate_kept_ratio", "specgate_live_sessions",
                 "specgate_kv_bytes_ram", "specgate_queue_depth", "specgate_speculator_scored_tokens_total"):
        assert name in text, name
    assert 'specgate_specprefill_total{status="active"}' in text


def test_a_replayed_request_replaces_its_orphaned_first_copy(gateway):
    """A second turn for a running session is 409 -- unless it carries the running turn's
    X-Request-Id: then it is the same request replayed by the balancer (the replica relaying
    the first copy died), so the first copy is cancelled and the replay is served."""
    sid = new_session(gateway)
    body = {"messages": [{"role": "user", "content": "Count to 300."}], "max_tokens": 300, "stream": True}
    headers = {"X-SpecGate-Session": sid, "X-Request-Id": "req-replayed-1"}
    with httpx.stream("POST", gateway.base + "/v1/chat/completions", headers=headers, json=body,
                      timeout=120) as first:
        lines = first.iter_lines()
        next(line for line in lines if '"content"' in line and '"role"' not in line)  # running now
        other = httpx.post(gateway.base + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2},
                           headers={**headers, "X-Request-Id": "req-other"}, timeout=120)
        assert other.status_code == 409 and other.json()["error"]["code"] == "session_busy"
        replay = httpx.post(gateway.base + "/v1/chat/completions", json={**body, "stream": False, "max_tokens": 2},
                            headers=headers, timeout=120)
        rest = list(lines)
    assert replay.status_code == 200, replay.text
    assert replay.json()["usage"]["completion_tokens"] == 2
    assert not any('"finish_reason":"length"' in line for line in rest)  # the first copy was cut short


def test_web_pages_cannot_drive_the_keyless_loopback_default(gateway):
    """What a page can send without a CORS preflight (text/plain), from its own origin or
    through a name rebound to 127.0.0.1, is refused; this machine's clients are not."""
    url = gateway.base + "/v1/chat/completions"
    body = b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}'
    as_json = {"Content-Type": "application/json"}
    assert error_of(httpx.post(url, content=body, headers={"Content-Type": "text/plain"}))[:2] == \
        (415, "unsupported_media_type")
    for foreign in ({"Origin": "https://evil.example"}, {"Host": "evil.example:8080"}, {"Origin": "null"}):
        assert error_of(httpx.post(url, content=body, headers={**as_json, **foreign}))[:2] == (403, "forbidden_origin")
    assert httpx.get(gateway.base + "/v1/models", headers={"Host": "rebound.example"}).status_code == 403
    assert httpx.get(gateway.base + "/v1/sessions/x/ws", headers={"Origin": "https://evil.example"}).status_code == 403
    r = httpx.post(gateway.base + "/v1/messages", headers={**as_json, "Origin": "https://evil.example"},
                   content=b'{"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}')
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"  # in Anthropic's shape
    local = httpx.post(url, content=body, headers={**as_json, "Origin": "http://localhost:3000"})
    assert local.status_code == 200, local.text
