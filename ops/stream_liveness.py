"""Replay a recorded agent request as a stream and time every event: does a long prefill's
stream stay alive (keepalives at most every ``--keepalive-s``) through whatever sits between,
e.g. an HAProxy with ``timeout server 60s``?

    .venv/bin/python ops/stream_liveness.py URL FIXTURE [--out results/bench/stream_liveness.json]

URL is the base the client would use (http://127.0.0.1:PORT); FIXTURE a recording from
ops/record_clients.py (tests/fixtures/clients/), sent unchanged, headers included.  Writes
the arrival time of each SSE event and comment, the largest gap, the time to the first
token and the total, as JSON.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import httpx

from bench.common import machine, provenance

SKIPPED = {"host", "content-length", "connection", "accept-encoding"}


def replay(base: str, fixture: Path) -> dict:
    entry = json.loads(fixture.read_text())
    headers = {k: v for k, v in entry["headers"].items() if k.lower() not in SKIPPED}
    t0 = time.monotonic()
    arrivals: list[tuple[float, str]] = []
    status = None
    with httpx.stream(entry["method"], base + entry["path"], json=entry["body"], headers=headers,
                      timeout=httpx.Timeout(10.0, read=3600.0)) as r:
        status = r.status_code
        event = None
        for line in r.iter_lines():
            if line.startswith(":"):
                kind = "comment"
            elif line.startswith("event: "):
                event = line[7:]
                continue
            elif line.startswith("data: "):
                kind, event = event or "data", None
            else:
                continue
            arrivals.append((time.monotonic() - t0, kind))
    times = [t for t, _ in arrivals]
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    first_token = next((t for t, kind in arrivals if kind in ("content_block_delta", "response.output_text.delta",
                                                             "data")), None)
    return {"fixture": fixture.name, "status": status, "total_s": round(times[-1], 1) if times else None,
            "first_token_s": round(first_token, 1) if first_token else None,
            "max_gap_s": round(max(gaps), 2) if gaps else None,
            "pings": sum(kind in ("ping", "comment") for _, kind in arrivals), "events": len(arrivals),
            "arrivals": [(round(t, 2), kind) for t, kind in arrivals], **provenance(), "machine": machine()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("url")
    parser.add_argument("fixture", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    result = replay(args.url.rstrip("/"), args.fixture)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "arrivals"}))


if __name__ == "__main__":
    main()
