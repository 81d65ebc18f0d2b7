"""``specgate bench failover``: a 2-replica cluster (ops/cluster.sh: redis-server, HAProxy)
on tiny models; 20 sessions x 6 turns, 4 clients at a time, one replica SIGKILLed
during turn 4 while it is running turns.

It reports turns served, turns in flight on the dead replica at the kill,
turns rebuilt on the surviving replica, the extra TTFT a rebuild costs
(rebuilt turns against the same turn index served from live KV), and the
errors clients saw (a client retries a failed request once; both are counted).
"""

from __future__ import annotations

import signal
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.cluster import Cluster
from bench.common import progress, write_result
from bench.soak import WORDS


def one_turn(http: httpx.Client, sid: str, history: list[dict[str, Any]], text: str,
             errors: list[str]) -> dict[str, Any] | None:
    history.append({"role": "user", "content": text})
    for attempt in (1, 2):
        try:
            r = http.post("/v1/chat/completions", headers={"X-SpecGate-Session": sid},
                          json={"messages": history, "max_tokens": 8})
            if r.status_code == 200:
                body = r.json()
                history.append(body["choices"][0]["message"])
                return {"replica": r.headers.get("X-SpecGate-Replica"), **body["timings"]}
            errors.append(f"{sid}: attempt {attempt}: HTTP {r.status_code} {r.text[:120]}")
        except httpx.HTTPError as exc:
            errors.append(f"{sid}: attempt {attempt}: {type(exc).__name__}")
        time.sleep(0.5)
    history.pop()
    return None


def run(tiny_target: str, tiny_speculator: str, out: Path, n_sessions: int = 20, turns: int = 6) -> dict[str, Any]:
    cluster = Cluster(Path(tempfile.mkdtemp(prefix="specgate-failover-")), 2, {
        "SPECGATE_TARGET": tiny_target, "SPECGATE_SPECULATOR": tiny_speculator, "SPECGATE_N_CTX": "8192",
        "SPECGATE_N_THREADS": "1", "SPECGATE_MIN_TOKENS": "0", "SPECGATE_LOG_LEVEL": "warning"})
    rows: list[dict[str, Any]] = []
    errors: list[str] = []
    histories: dict[str, list[dict[str, Any]]] = {f"f-{i:02d}": [{"role": "system", "content": "You log pumps."}]
                                                  for i in range(n_sessions)}
    box: list[int] = []  # turns running on r2 when it was killed
    try:
        with httpx.Client(base_url=cluster.base, timeout=300) as http, ThreadPoolExecutor(4) as pool:
            for t in range(turns):
                killer = None
                if t == turns // 2:
                    killer = threading.Thread(target=kill_while_running, args=(cluster, 2, box))
                    killer.start()
                progress(f"failover: turn {t + 1} of {turns}")

                def go(item: tuple[int, tuple[str, list[dict[str, Any]]]], t: int = t) -> None:
                    i, (sid, history) = item
                    text = f"Turn {t}: " + " ".join(WORDS[(i + t + k) % len(WORDS)] for k in range(150))
                    timing = one_turn(http, sid, history, text, errors)
                    if timing is not None:
                        rows.append({"session": sid, "turn": t + 1, **timing})

                list(pool.map(go, enumerate(histories.items())))
                if killer is not None:
                    killer.join()
        intact = sum((cluster.record("anonymous", sid) or {}).get("history") == h for sid, h in histories.items())
    finally:
        cluster.down()
    after = [r for r in rows if r["turn"] > turns // 2]
    rebuilt = [r["ttft_ms"] for r in after if r["kv_rebuilt"]]
    live = [r["ttft_ms"] for r in after if not r["kv_rebuilt"]]
    summary = {"sessions": n_sessions, "turns_per_session": turns, "turns_served": len(rows),
               "turns_expected": n_sessions * turns, "turns_rebuilt": len(rebuilt),
               "rebuilt_ttft_ms_median": round(statistics.median(rebuilt), 1) if rebuilt else None,
               "live_ttft_ms_median": round(statistics.median(live), 1) if live else None,
               "extra_ttft_ms_per_rebuild": round(statistics.median(rebuilt) - statistics.median(live), 1)
               if rebuilt and live else None,
               "client_errors": len(errors), "histories_intact": intact,
               "turns_running_on_r2_at_kill": box[0] if box else 0}
    write_result(out, "failover", {"summary": summary, "rows": rows, "errors": errors},
                 {"target": tiny_target, "speculator": tiny_speculator})
    return summary


def kill_while_running(cluster: Cluster, i: int, box: list[int], timeout_s: float = 120) -> None:
    """SIGKILL replica ``i`` as soon as its /metrics shows a turn running; ``box`` gets how many."""
    deadline = time.monotonic() + timeout_s
    url = cluster.url(i) + "/metrics"
    while time.monotonic() < deadline:
        try:
            text = httpx.get(url, timeout=5).text
        except httpx.HTTPError:
            continue
        running = next(float(line.split()[1]) for line in text.splitlines()
                       if line.startswith("specgate_running_turns "))
        if running >= 1:
            progress(f"failover: SIGKILL replica r{i} with {int(running)} turn(s) running")
            cluster.kill(i, signal.SIGKILL)
            box.append(int(running))
            return
        time.sleep(0.01)
    cluster.kill(i, signal.SIGKILL)
