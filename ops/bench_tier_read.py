"""How long does the Redis KV tier take to read back an entry the size of a deep session's
checkpoint?  The lookup deadline (``--kv-tier-timeout-s`` plus a second per
``READ_FLOOR_BPS`` of the entry) has to cover it on a busy machine.

    .venv/bin/python ops/bench_tier_read.py [entry_mb]   # default 470: 11.7K tokens, both models
    -> prints the times and writes results/bench/tier_read.json

One redis-server of its own on a free port (no persistence); one entry written and flushed,
then read back three times through ``RedisTier.get`` (head, chunks, checksum), and once raw.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from bench.common import free_port, write_result
from sessions.kv.tier import READ_FLOOR_BPS, TierSettings
from sessions.kv.tier_redis import RedisTier


def timed(fn: object) -> float:
    t0 = time.monotonic()
    fn()  # type: ignore[operator]
    return round(time.monotonic() - t0, 2)


def main(entry_mb: int) -> None:
    port = free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL)
    try:
        time.sleep(0.5)
        tier = RedisTier(f"redis://127.0.0.1:{port}/1", TierSettings(b"bench", 8 << 30, b"secret", timeout_s=600))
        size = entry_mb << 20
        blobs = (os.urandom(size * 7 // 10), os.urandom(size - size * 7 // 10))
        write_s = timed(lambda: (tier.put("entry", blobs), tier.flush()))
        gets = [timed(lambda: tier.get("entry")) for _ in range(3)]
        raw = timed(lambda: tier._read(tier.name("entry")))
        row = {"entry_mb": entry_mb, "write_s": write_s, "get_s": gets, "raw_read_s": raw,
               "deadline_s": round(5.0 + size / READ_FLOOR_BPS, 1), "hits": tier.hits}
        print(row)
        tier.close()
        write_result(Path("results/bench/tier_read.json"), "tier_read", {"rows": [row]}, {})
    finally:
        server.terminate()


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 470)
