"""A session whose replica is SIGKILLed continues on another from its KV checkpoint: two
replicas behind the real HAProxy, a real redis-server, and one KV tier folder they share (a
shared mount's stand-in), all started by ops/cluster.sh.  Idle time on the owner saves the
session's KV to the tier; after the owner dies, the replica that takes the session over
restores that checkpoint and prefills only the tokens after it."""

from __future__ import annotations

import shutil
import signal

import httpx
import pytest

from bench.cluster import Cluster
from tests.support import until

pytestmark = pytest.mark.redis

SYSTEM = ("You operate the plant. Units report flow, pressure and temperature every minute; alarms name "
          "the unit, the reading and the limit it crossed. ") * 40  # ~1.2K tokens
LOG = "unit 7 flow 41.2 pressure 3.1 temperature 77 ok; " * 60  # ~1K tokens: a tool's output


@pytest.fixture(scope="module")
def cluster(tiny_target, tiny_speculator, tmp_path_factory):
    if shutil.which("haproxy") is None:
        pytest.fail("haproxy not installed: run ops/test.sh, which installs it")
    root = tmp_path_factory.mktemp("takeover")
    c = Cluster(root / "cluster", 2, {
        "SPECGATE_TARGET": str(tiny_target), "SPECGATE_SPECULATOR": str(tiny_speculator),
        "SPECGATE_N_CTX": "8192", "SPECGATE_N_THREADS": "1", "SPECGATE_CALIBRATE_TOKENS": "32",
        "SPECGATE_LEASE_MS": "4000", "SPECGATE_KV_TIER_DIR": str(root / "tier"),
        "SPECGATE_KV_CHECKPOINT_TOKENS": "256"})
    yield c
    c.down()


def turn(base: str, history: list[dict], text: str) -> dict:
    history.append({"role": "user", "content": text})
    r = httpx.post(base + "/v1/chat/completions", headers={"X-SpecGate-Session": "tk-1"}, timeout=120,
                   json={"messages": history, "max_tokens": 4, "specprefill": False})
    assert r.status_code == 200, r.text
    history.append(r.json()["choices"][0]["message"])
    return {**r.json()["timings"], "replica": r.headers["X-SpecGate-Replica"]}


def checkpoints(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return next(float(line.split()[1]) for line in text.splitlines()
                if line.startswith("specgate_session_checkpoints_total "))


def test_a_session_continues_from_its_checkpoint_after_its_replica_is_sigkilled(cluster):
    history = [{"role": "system", "content": SYSTEM}]
    assert turn(cluster.url(2), history, "Read the log: " + LOG)["replica"] == "r2"
    assert until(lambda: checkpoints(cluster.url(2)) >= 1, timeout_s=60)
    last = turn(cluster.url(2), history, "And this one: " + LOG.replace("unit 7", "unit 9"))
    assert until(lambda: checkpoints(cluster.url(2)) >= 2, timeout_s=60)  # the second turn's, too
    cluster.kill(2, signal.SIGKILL)
    t = turn(cluster.base, history, "Which unit ran hotter?")  # HAProxy sends it on; r1 takes it over
    assert t["replica"] == "r1" and t["kv_rebuilt"], t
    assert t["prefix_shared_n"] >= last["context_n"] - 8, t  # all but the reply's re-rendered end
    assert t["prefix_source"] == "checkpoint" and t["prefix_bytes"] > 0
    assert t["prompt_n"] == t["context_n"] - t["prefix_shared_n"]
    assert t["prompt_n"] <= 0.2 * t["context_n"]  # the bound: at most 20% of a full rebuild
    cluster.wait_exit(2)
