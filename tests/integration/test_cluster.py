"""Two replicas behind the real HAProxy, with a real redis-server, started by ops/cluster.sh:
affinity, proxying to the owner, the ownership race, a rolling restart, an owner killed while
a turn is proxied to it, turns in flight when a replica dies, and a SIGKILL failover.

No test sleeps to let something happen: each waits for the state it needs (a replica's
running turns in its /metrics, a server's status on HAProxy's stats socket)."""

from __future__ import annotations

import shutil
import signal
import threading
import time

import httpx
import orjson
import pytest

from bench.cluster import Cluster

pytestmark = pytest.mark.redis


@pytest.fixture(scope="module")
def cluster(tiny_target, tiny_speculator, tmp_path_factory):
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy not installed: run ops/test.sh, which installs it")
    c = Cluster(tmp_path_factory.mktemp("cluster"), 2, {
        "SPECGATE_TARGET": str(tiny_target), "SPECGATE_SPECULATOR": str(tiny_speculator),
        "SPECGATE_N_CTX": "16384", "SPECGATE_N_THREADS": "1", "SPECGATE_CALIBRATE_TOKENS": "32",
        "SPECGATE_MIN_TOKENS": "0", "SPECGATE_LEASE_MS": "4000",
        # the rolling restart's 300-token stream must finish within the drain however slow the
        # machine is (past the timeout a drain cancels it, well-formed, which is not this test)
        "SPECGATE_DRAIN_TIMEOUT_S": "600"})
    yield c
    c.down()


def turn(base: str, sid: str, history: list[dict], text: str, **extra) -> httpx.Response:
    history.append({"role": "user", "content": text})
    r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                   json={"messages": history, "max_tokens": 4, **extra})
    if r.status_code == 200:
        history.append(r.json()["choices"][0]["message"])
    else:
        history.pop()
    return r


def stored_history(cluster, sid: str, expected: list[dict], timeout: float = 60) -> list[dict]:
    """The session's history in Redis once it equals ``expected`` (records are written off
    the reply path, so a loaded machine may show the previous turn's for a moment), or the
    last one read after ``timeout``."""
    deadline = time.monotonic() + timeout
    while (history := cluster.record("anonymous", sid)["history"]) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return history


def replica(r: httpx.Response) -> str:
    return r.headers["X-SpecGate-Replica"]


def running_turns(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines() if line.startswith("specgate_running_turns "))


def wait_running(url: str, at_least: int = 1, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while running_turns(url) < at_least:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} never ran {at_least} turn(s) at once")
        time.sleep(0.02)


def kill_r2_while(cluster, go, keys: list[str]) -> None:
    """Run ``go(key)`` for every key at once, SIGKILL r2 as soon as it runs one, wait for all."""
    threads = [threading.Thread(target=go, args=(key,)) for key in keys]
    for th in threads:
        th.start()
    wait_running(cluster.url(2))
    cluster.kill(2, signal.SIGKILL)
    for th in threads:
        th.join()


def owned_by(cluster, i: int, sid: str) -> list[dict]:
    """A new session whose first turn ran on replica ``i`` (so ``i`` holds its lease)."""
    history: list[dict] = [{"role": "system", "content": "You log pumps."}]
    r = turn(cluster.url(i), sid, history, "Pump A ran.")
    assert r.status_code == 200 and replica(r) == f"r{i}", r.text
    return history


@pytest.fixture(scope="module")
def sessions(cluster):
    """12 sessions with one turn each through the balancer: {sid: (history, replica)}."""
    out = {}
    for i in range(12):
        history: list[dict] = [{"role": "system", "content": "You log pumps."}]
        r = turn(cluster.base, f"c-{i}", history, f"Pump {i} ran {i * 7} minutes.")
        assert r.status_code == 200, r.text
        out[f"c-{i}"] = (history, replica(r))
    return out


def test_affinity_sticks_each_session_to_one_replica(cluster, sessions):
    assert {rep for _, rep in sessions.values()} == {"r1", "r2"}  # the hash spreads them
    for sid, (history, rep) in sessions.items():
        r = turn(cluster.base, sid, history, "And the next pump?")
        assert r.status_code == 200 and replica(r) == rep, sid
        assert r.json()["timings"]["cache_n"] > 0 and not r.json()["timings"]["kv_rebuilt"]


def test_a_conversation_naming_no_session_keeps_its_replica_and_its_kv(cluster):
    """As agent frameworks send it: the whole history each time, no session header.  The
    balancer keeps the caller on one replica, which finds the conversation by its tokens."""
    history: list[dict] = [{"role": "system", "content": "You log pumps: each pump's minutes, and which ran longest."}]
    served, prompts = [], []
    for text in ("Pump A ran 5 minutes.", "Pump B ran 7 minutes.", "Which ran longer?"):
        history.append({"role": "user", "content": text})
        r = httpx.post(cluster.base + "/v1/chat/completions", timeout=120, json={"messages": history, "max_tokens": 4})
        assert r.status_code == 200, r.text
        history.append(r.json()["choices"][0]["message"])
        served.append((replica(r), r.headers["X-SpecGate-Session"]))
        usage = r.json()["usage"]
        prompts.append((usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    assert len(set(served)) == 1 and served[0][1].startswith("conv-")
    assert prompts[1][1] >= prompts[0][0] and prompts[2][1] >= prompts[1][0]  # each turn reused the last prompt


def test_a_turn_on_the_wrong_replica_is_proxied_to_the_owner(cluster, sessions):
    sid, (history, rep) = next(iter(sessions.items()))
    other = 2 if rep == "r1" else 1
    r = turn(cluster.url(other), sid, history, "Still there?")
    assert r.status_code == 200 and replica(r) == rep  # served where its KV lives
    assert r.json()["timings"]["cache_n"] > 0


def test_racing_replicas_take_over_a_session_exactly_once(cluster):
    """A session neither replica holds (its owner is gone; its record is in Redis): both
    get a turn for it at once; one takes the lease, the other proxies to it (or finds it
    busy), and the record's version counts every turn that ran, none lost."""
    import redis

    history = [{"role": "user", "content": "Race me."}, {"role": "assistant", "content": "Ready."}]
    record = {"id": "race-1", "owner": "anonymous", "turns": 1, "history": history, "version": 5}
    redis.Redis(port=cluster.redis_port).set("specgate:session:anonymous:race-1", orjson.dumps(record))
    results: list[httpx.Response] = []
    barrier = threading.Barrier(2)

    def go(i: int) -> None:
        barrier.wait()
        results.append(turn(cluster.url(i), "race-1", list(history), f"From replica {i}."))

    threads = [threading.Thread(target=go, args=(i,)) for i in (1, 2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    ok = [r for r in results if r.status_code == 200]
    assert ok and all(r.status_code in (200, 409) for r in results), [r.text for r in results]
    assert len({replica(r) for r in ok}) == 1  # one owner served every turn that ran
    assert all(r.json()["timings"]["kv_rebuilt"] for r in ok[:1])  # taken over from the stored history
    deadline = time.monotonic() + 60  # written off the reply path: wait for it, then for nothing more
    while (stored := cluster.record("anonymous", "race-1"))["turns"] < 1 + len(ok) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stored["version"] == 5 + len(ok) and stored["turns"] == 1 + len(ok)  # no write lost or doubled


def test_rolling_restart_drains_a_replica_and_its_sessions_continue(cluster, sessions):
    victim = 1
    mine = [(sid, h) for sid, (h, rep) in sessions.items() if rep == f"r{victim}"]
    sid, history = mine[0]
    with httpx.stream("POST", cluster.base + "/v1/chat/completions", headers={"X-SpecGate-Session": sid}, timeout=120,
                      json={"messages": [*history, {"role": "user", "content": "Count to 300."}],
                            "max_tokens": 300, "stream": True}) as resp:
        lines = resp.iter_lines()
        next(line for line in lines if '"content"' in line and '"role"' not in line)
        cluster.kill(victim, signal.SIGTERM)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]" and '"finish_reason":"length"' in "".join(rest)  # drained, not cut
    cluster.wait_exit(victim)
    for sid, history in mine:
        r = turn(cluster.base, sid, history, "Who serves me now?")
        assert r.status_code == 200 and replica(r) == "r2" and r.json()["timings"]["kv_rebuilt"], r.text
        assert stored_history(cluster, sid, history) == history  # intact on the new owner
        sessions[sid] = (history, "r2")
    cluster.restart(victim)


def test_owner_killed_while_a_streamed_turn_is_proxied_to_it(cluster):
    """r1 relays r2's stream; r2 dies mid-stream: the client's stream ends well-formed, with
    an in-band ``owner_lost`` error and ``[DONE]``; the retry is served by r1, rebuilt."""
    history = owned_by(cluster, 2, "px-stream")
    events = []
    with httpx.stream("POST", cluster.url(1) + "/v1/chat/completions", headers={"X-SpecGate-Session": "px-stream"},
                      timeout=120, json={"messages": [*history, {"role": "user", "content": "Count to 300."}],
                                         "max_tokens": 300, "stream": True}) as resp:
        assert resp.status_code == 200 and replica(resp) == "r2"
        lines = resp.iter_lines()
        next(line for line in lines if '"content"' in line and '"role"' not in line)
        cluster.kill(2, signal.SIGKILL)
        events = [line for line in lines if line.startswith("data: ")]  # no RemoteProtocolError: ends whole
    assert events[-1] == "data: [DONE]"
    assert orjson.loads(events[-2][6:])["error"]["code"] == "owner_lost", events[-3:]
    cluster.wait_exit(2)
    r = turn(cluster.url(1), "px-stream", history, "Again?")
    assert r.status_code == 200 and replica(r) == "r1" and r.json()["timings"]["kv_rebuilt"], r.text
    assert stored_history(cluster, "px-stream", history) == history
    cluster.restart(2)


def test_owner_killed_while_a_whole_turn_is_proxied_to_it(cluster):
    """r1 waits on r2's non-streamed answer; r2 dies while running it: nothing of the answer
    was sent, so r1 takes the session over and the client gets a normal, rebuilt answer."""
    history = owned_by(cluster, 2, "px-whole")
    history.append({"role": "user", "content": "Count to 300."})
    out: list[httpx.Response] = []
    th = threading.Thread(target=lambda: out.append(httpx.post(
        cluster.url(1) + "/v1/chat/completions", headers={"X-SpecGate-Session": "px-whole"}, timeout=120,
        json={"messages": history, "max_tokens": 300})))
    th.start()
    wait_running(cluster.url(2))
    cluster.kill(2, signal.SIGKILL)
    th.join()
    r = out[0]
    assert r.status_code == 200 and replica(r) == "r1" and r.json()["timings"]["kv_rebuilt"], r.text
    history.append(r.json()["choices"][0]["message"])
    assert stored_history(cluster, "px-whole", history) == history
    cluster.wait_exit(2)
    cluster.restart(2)


def test_turns_in_flight_through_the_balancer_when_a_replica_dies(cluster):
    """Six sessions on r2 and two on r1, a long turn each through HAProxy; r2 is SIGKILLed
    while running one.  Every client gets a 200: HAProxy replays what r2 never answered
    (refused or closed without a response), and r1 takes the sessions over."""
    histories = {f"fl-{i}": owned_by(cluster, 2 if i < 6 else 1, f"fl-{i}") for i in range(8)}
    results: dict[str, httpx.Response] = {}

    def go(sid: str) -> None:
        results[sid] = turn(cluster.base, sid, histories[sid], "Count to 200.", max_tokens=200)

    kill_r2_while(cluster, go, list(histories))
    assert all(r.status_code == 200 for r in results.values()), {s: r.text[:200] for s, r in results.items()}
    assert any(r.json()["timings"]["kv_rebuilt"] for r in results.values())  # some really moved
    for sid, history in histories.items():
        assert stored_history(cluster, sid, history) == history, sid
    cluster.wait_exit(2)
    cluster.restart(2)


# what an agent's history carries besides its prompt: ~78 KB of the model's own reasoning sent
# back (Claude Code's thinking blocks, Codex's reasoning items), which the prompt leaves out
REASONING = "Let me think about the pump logs step by step. " * 1600


def agent_message(text: str) -> dict:
    return {"model": "claude-test", "max_tokens": 200, "system": "You log pumps.", "messages": [
        {"role": "user", "content": "Pump A ran."},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING, "signature": "sig"},
                                          {"type": "text", "text": "Noted."}]},
        {"role": "user", "content": text}]}


def test_agent_sized_bodies_in_flight_are_replayed_when_a_replica_dies(cluster):
    """~80 KB Anthropic and Responses bodies through HAProxy, whole (not streamed), for
    sessions r2 owns; r2 is SIGKILLed while running them.  HAProxy buffers each body
    (tune.bufsize), so what r2 never answered is replayed on r1, which takes the sessions over."""
    sids = [f"ag-{i}" for i in range(4)]
    for sid in sids:
        owned_by(cluster, 2, sid)
    first = httpx.post(cluster.url(2) + "/v1/responses", timeout=120,
                       json={"instructions": "You log pumps.", "input": "Pump A ran.", "max_output_tokens": 4})
    assert first.status_code == 200 and replica(first) == "r2"
    results: dict[str, httpx.Response] = {}
    bodies = {sid: agent_message("Count to 200.") for sid in sids}
    bodies["responses"] = {"instructions": "You log pumps.", "previous_response_id": first.json()["id"],
                           "max_output_tokens": 200, "input": [
                               {"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text",
                                                                             "text": REASONING}]},
                               {"role": "user", "content": "Count to 200."}]}
    assert all(len(orjson.dumps(b)) > 75_000 for b in bodies.values())

    def go(key: str) -> None:
        if key == "responses":
            results[key] = httpx.post(cluster.base + "/v1/responses", timeout=180, json=bodies[key])
        else:
            results[key] = httpx.post(cluster.base + "/v1/messages", timeout=180, json=bodies[key],
                                      headers={"X-SpecGate-Session": key})

    kill_r2_while(cluster, go, list(bodies))
    assert all(r.status_code == 200 for r in results.values()), {k: r.text[:300] for k, r in results.items()}
    assert {replica(r) for r in results.values()} == {"r1"}
    for sid in sids:
        assert results[sid].json()["content"][0]["text"]
        deadline = time.monotonic() + 60
        while (rec := cluster.record("anonymous", sid))["turns"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rec["turns"] == 2 and rec["history"][-2]["content"] == "Count to 200.", rec["history"][-2:]
    done = results["responses"].json()  # whole: tiny models never stop, so it ran to its token limit
    assert done["status"] == "incomplete" and done["incomplete_details"]["reason"] == "max_output_tokens"
    cluster.wait_exit(2)
    cluster.restart(2)


# ~12K tokens: a prefill of several seconds even for the tiny pair, so r2 dies in it
LOG = "the build log shows a warning in module alpha then a retry in module beta " * 800


def read_stream(r: httpx.Response) -> list[str]:
    """The event names (or Chat's data) of a whole SSE stream."""
    return [line[7:] if line.startswith("event: ") else line[6:] for line in r.iter_lines()
            if line.startswith(("event: ", "data: [DONE]"))]


def test_streamed_agent_turns_are_replayed_when_their_replica_dies_in_the_prefill(cluster):
    """Streamed ~140 KB Anthropic and Responses turns for conversations r2 owns, through
    HAProxy; r2 is SIGKILLed while it prefills them.  A stream's headers wait for its first
    token (--stream-hold-s, 290 s in ops/cluster.sh), so r2 had answered nothing, HAProxy
    replays each request on r1, and every client reads a whole stream: no error at all."""
    owned_by(cluster, 2, "st-a")
    first = httpx.post(cluster.url(2) + "/v1/responses", timeout=120,
                       json={"instructions": "You log pumps.", "input": "Pump A ran.", "max_output_tokens": 4})
    assert first.status_code == 200 and replica(first) == "r2"
    bodies = {"st-a": ("/v1/messages", {**agent_message(LOG), "max_tokens": 8, "stream": True}),
              "st-r": ("/v1/responses", {"instructions": "You log pumps.", "max_output_tokens": 8, "stream": True,
                                         "previous_response_id": first.json()["id"], "input": [
                                             {"type": "reasoning", "id": "rs_1", "summary": [
                                                 {"type": "summary_text", "text": REASONING}]},
                                             {"role": "user", "content": LOG}]})}
    assert all(len(orjson.dumps(b)) > 100_000 for _, b in bodies.values())
    seen: dict[str, tuple[int, str, list[str]]] = {}

    def go(key: str) -> None:
        path, body = bodies[key]
        headers = {"X-SpecGate-Session": key} if key == "st-a" else {}
        with httpx.stream("POST", cluster.base + path, json=body, headers=headers, timeout=300) as r:
            seen[key] = (r.status_code, replica(r), read_stream(r))  # a cut stream raises here

    kill_r2_while(cluster, go, list(bodies))
    assert seen["st-a"][:2] == (200, "r1") and seen["st-a"][2][-1] == "message_stop", seen["st-a"]
    assert seen["st-r"][:2] == (200, "r1") and seen["st-r"][2][-1] == "response.completed", seen["st-r"]
    assert "error" not in seen["st-a"][2] and "response.failed" not in seen["st-r"][2]
    deadline = time.monotonic() + 60
    while (rec := cluster.record("anonymous", "st-a"))["turns"] < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert rec["turns"] == 2 and rec["history"][-2]["content"] == LOG
    cluster.wait_exit(2)
    cluster.restart(2)


def test_a_responses_chain_continues_on_another_replica_after_its_owner_dies(cluster):
    """Responses name no session header, so HAProxy spreads them; previous_response_id finds
    the conversation's owner through the registry (proxied there, its KV reused), and after
    the owner is SIGKILLed a live replica continues the chain from the record in Redis."""
    def create(**body) -> httpx.Response:
        r = httpx.post(cluster.base + "/v1/responses", timeout=120, json={"max_output_tokens": 4, **body})
        assert r.status_code == 200, r.text
        return r

    r1 = create(instructions="You log pumps.", input="Pump A ran 5 minutes.")
    owner = replica(r1)
    r2 = create(instructions="You log pumps.", input="Pump B ran 7 minutes.", previous_response_id=r1.json()["id"])
    assert replica(r2) == owner  # served where the conversation's KV lives, whichever replica HAProxy chose
    assert r2.json()["usage"]["input_tokens_details"]["cached_tokens"] >= r1.json()["usage"]["input_tokens"]
    victim = int(owner[1:])
    cluster.kill(victim, signal.SIGKILL)
    r3 = create(instructions="You log pumps.", input="Which pumps ran?", previous_response_id=r2.json()["id"])
    assert replica(r3) != owner and r3.json()["timings"]["kv_rebuilt"]
    assert r3.json()["usage"]["input_tokens"] > r2.json()["usage"]["input_tokens"]  # turns 1 and 2 are in it
    cluster.wait_exit(victim)
    cluster.restart(victim)


def test_sigkill_failover_moves_sessions_with_their_history(cluster, sessions):
    for sid, (history, _) in sessions.items():  # r1 is back; sessions that moved stay with r2 (proxied)
        assert turn(cluster.base, sid, history, "Checking in.").status_code == 200
    owners = {sid: cluster.record("anonymous", sid) for sid in sessions}
    victim = 2
    cluster.kill(victim, signal.SIGKILL)
    survivors = 0
    for sid, (history, _) in sessions.items():
        r = turn(cluster.base, sid, history, "After the crash?")
        assert r.status_code == 200, r.text  # the balancer retries a refused connection elsewhere
        assert replica(r) == "r1"
        moved = r.json()["timings"]["kv_rebuilt"]
        survivors += not moved
        assert stored_history(cluster, sid, history) == history
        assert cluster.record("anonymous", sid)["version"] > owners[sid]["version"]
    assert survivors < len(sessions)  # some sessions really moved (and were rebuilt)
