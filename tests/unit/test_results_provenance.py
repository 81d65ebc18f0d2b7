"""Every committed result can be traced: the JSON holds the commit, the command and the machine
it came from (bench/common.py writes them), or, for runs older than that, a ``provenance``
entry added after the fact that says so, with the commit that added it and its documented
command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

RESULTS = Path(__file__).resolve().parents[2] / "results"
INPUTS = {"prefill/needle3k_prompt.json"}  # a bench's input, not a result


def result_files() -> list[Path]:
    return [p for p in sorted(RESULTS.glob("**/*.json")) if p.relative_to(RESULTS).as_posix() not in INPUTS]


@pytest.mark.parametrize("path", result_files(), ids=lambda p: p.relative_to(RESULTS).as_posix())
def test_a_result_names_its_commit_command_and_machine(path: Path) -> None:
    data = json.loads(path.read_text())
    recorded = data.get("commit") and data.get("command") and data.get("command") != ["-c"]
    if recorded:
        assert data.get("machine", {}).get("cpu"), "a recorded run names its CPU"
        return
    prov = data.get("provenance")
    assert prov, "no commit and command, and no provenance saying why"
    assert prov["recorded_by_the_run"] is False and len(prov["committed_in"]) == 40 and prov["command"]
    assert data.get("machine") or prov.get("machine")
