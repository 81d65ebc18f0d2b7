"""``specgate bench fuzz``: schemathesis against a live ``specgate serve`` on tiny models.

schemathesis reads ``/openapi.json``, generates requests from it (valid and
invalid: the coverage, fuzzing and stateful phases) and fails a case on any
5xx (``not_a_server_error``).  The CI suite runs a short fuzz
(tests/integration/test_fuzz.py); this command runs a longer one and writes
``results/bench/fuzz.json``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.common import free_port, progress, write_result
from bench.serving import server, specgate_cmd
from core.config import EngineConfig

FUZZ_KEY = "sk-fuzz"


def schemathesis(base: str, examples: int, seed: int = 1) -> dict[str, Any]:
    """Run the schemathesis CLI; the counts come from its summary."""
    exe = Path(sys.executable).parent / "schemathesis"
    proc = subprocess.run([str(exe if exe.exists() else "schemathesis"), "run", f"{base}/openapi.json",
                           "--checks", "not_a_server_error", "-n", str(examples), "--seed", str(seed),
                           "-H", f"Authorization: Bearer {FUZZ_KEY}", "--request-timeout", "120", "--no-color"],
                          capture_output=True, text=True, timeout=3600)
    generated = re.search(r"(\d+) generated", proc.stdout)
    failures = re.search(r"found (\d+) unique failures", proc.stdout)
    return {"exit_code": proc.returncode, "cases": int(generated.group(1)) if generated else 0,
            "server_errors": int(failures.group(1)) if failures else 0, "examples": examples, "seed": seed,
            "output_tail": proc.stdout[-2000:]}


def run(tiny_target: str, tiny_speculator: str, out: Path, examples: int = 200) -> dict[str, Any]:
    port = free_port()
    logs = out.parent / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    engine = EngineConfig(target=tiny_target, speculator=tiny_speculator, n_ctx=4096)
    cmd = specgate_cmd(port, engine, max_queue=256, min_tokens=0)
    with server(cmd, port, logs / "fuzz.log", env={"SPECGATE_API_KEYS": FUZZ_KEY}) as base:
        progress(f"fuzz: schemathesis, {examples} examples per operation")
        summary = schemathesis(base, examples)
    write_result(out, "fuzz", summary, {"target": tiny_target, "speculator": tiny_speculator})
    return summary
