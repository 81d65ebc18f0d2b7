"""A local cluster through ``ops/cluster.sh`` (redis-server, N replicas, HAProxy), for the
cluster tests and ``specgate bench failover``."""

from __future__ import annotations

import contextlib
import csv
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import free_port

ROOT = Path(__file__).resolve().parent.parent


class Cluster:
    def __init__(self, directory: Path, n: int, env: dict[str, str]) -> None:
        self.dir = directory
        self._procs: dict[int, subprocess.Popen[bytes]] = {}  # replicas restarted by this process
        self.lb_port, self.redis_port = free_port(), free_port()
        first = free_port()
        while any(_busy(first + i) for i in range(n)):
            first = free_port()
        # no KV tier unless asked; streams' headers held as ops/cluster.sh holds them
        self.env = {**os.environ, "SPECGATE_KV_TIER_DIR": "", "SPECGATE_STREAM_HOLD_S": "290", **env,
                    "CLUSTER_DIR": str(directory), "LB_PORT": str(self.lb_port),
                    "FIRST_PORT": str(first), "REDIS_PORT": str(self.redis_port),
                    "SPECGATE": str(Path(sys.executable).parent / "specgate")}
        out = subprocess.run(["bash", str(ROOT / "ops/cluster.sh"), "up", str(n)], env=self.env, cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            self.down()
            raise RuntimeError(f"ops/cluster.sh up failed:\n{out.stdout}\n{out.stderr}\n{self.logs()}")
        self.base = out.stdout.strip().splitlines()[-1]
        for i in range(1, n + 1):
            self.wait_balanced(i, "UP")

    def port(self, i: int) -> int:
        return int((self.dir / f"replica-{i}.port").read_text())

    def pid(self, i: int) -> int:
        return int((self.dir / f"replica-{i}.pid").read_text())

    def url(self, i: int) -> str:
        return f"http://127.0.0.1:{self.port(i)}"

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        os.kill(self.pid(i), sig)

    def wait_exit(self, i: int, timeout: float = 120) -> None:
        if (proc := self._procs.get(i)) is not None:  # our child: reap it (a zombie still answers kill 0)
            proc.wait(timeout)
            return
        pid = self.pid(i)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        raise TimeoutError(f"replica {i} did not exit")

    def restart(self, i: int) -> None:
        """Start replica ``i`` again on its port (a rolling restart's second half)."""
        env = {**self.env, "SPECGATE_REDIS_URL": f"redis://127.0.0.1:{self.redis_port}/0",
               "SPECGATE_REPLICA_ID": f"r{i}"}
        with open(self.dir / f"replica-{i}.log", "ab") as log:
            proc = subprocess.Popen([self.env["SPECGATE"], "serve", "--port", str(self.port(i))], env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        (self.dir / f"replica-{i}.pid").write_text(str(proc.pid))
        self._procs[i] = proc
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url(i) + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise RuntimeError(f"replica {i} did not come back:\n{self.logs()}")
        self.wait_balanced(i, "UP")  # ready is not enough: HAProxy must have seen it rise

    def balancer_status(self) -> dict[str, str]:
        """Each replica's status as HAProxy sees it (``UP``, ``DOWN``, ``UP 1/2``, ...), read from
        its stats socket."""
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.dir / "haproxy.sock"))
            s.sendall(b"show stat\n")
            raw = b"".join(iter(lambda: s.recv(65536), b""))
        rows = list(csv.reader(raw.decode().lstrip("# ").splitlines()))
        head = rows[0]
        px, sv, st = head.index("pxname"), head.index("svname"), head.index("status")
        return {r[sv]: r[st] for r in rows[1:] if len(r) > st and r[px] == "replicas" and r[sv].startswith("r")}

    def wait_balanced(self, i: int, status: str, timeout: float = 60) -> None:
        """Until HAProxy reports replica ``i`` as exactly ``status`` (its checks run every second)."""
        deadline = time.monotonic() + timeout
        while (now := self.balancer_status().get(f"r{i}")) != status:
            if time.monotonic() > deadline:
                raise TimeoutError(f"HAProxy reports r{i} as {now!r}, not {status!r}")
            time.sleep(0.1)

    def record(self, owner: str, sid: str) -> dict[str, Any] | None:
        import redis

        raw = redis.Redis(port=self.redis_port).get(f"specgate:session:{owner}:{sid}")
        return None if raw is None else orjson.loads(raw)

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                         for p in sorted(self.dir.glob("*.log")))

    def down(self) -> None:
        subprocess.run(["bash", str(ROOT / "ops/cluster.sh"), "down"], env=self.env, cwd=ROOT, timeout=300,
                       capture_output=True)


@contextlib.contextmanager
def running(directory: Path, n: int, env: dict[str, str]) -> Iterator[Cluster]:
    """A cluster for the ``with`` block, taken down after it."""
    cluster = Cluster(directory, n, env)
    try:
        yield cluster
    finally:
        cluster.down()


def _busy(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0
