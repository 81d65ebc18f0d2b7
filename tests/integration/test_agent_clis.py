"""The coding agents people run, unchanged apart from their documented base-URL settings,
headless against a real ``specgate serve``: Claude Code (Anthropic Messages), Codex CLI
(Responses) and opencode (Chat Completions), at the versions ``ops/setup.sh --test``
pins in ``.clis/``, each in a scratch git repository with a fresh home.

The target is the real Qwen2.5-Coder-0.5B, scored by its 2-block cut: the smallest model
here that ends its replies.  A truncated tiny model runs every reply to ``max_tokens``, and
Claude Code answers a ``max_tokens`` stop by asking to continue, four times, then gives up
("exceeded the 128000 output token maximum"), so no CLI run could end cleanly on one.
Each agent's prompt is 6-12K tokens, so the server runs with a 16K context.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from core.models import model_files
from tests.support import ServerProcess, real_model

ROOT = Path(__file__).resolve().parents[2]
CLIS = ROOT / ".clis" / "node_modules" / ".bin"
pytestmark = pytest.mark.agents


@pytest.fixture(scope="module")
def server(tiny_speculator: Path):
    for name in ("claude", "codex", "opencode"):
        if not (CLIS / name).exists():
            pytest.fail(f"{CLIS / name} is missing: `bash ops/setup.sh --test` installs the agent CLIs")
    srv = ServerProcess(real_model(model_files.SPECULATOR), tiny_speculator, "--n-ctx", "16384",
                        "--scorer", "speculator-full", "--keepalive-s", "5")
    yield srv
    srv.stop()


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    """A scratch git repository with one commit, and a home of its own beside it."""
    work = tmp_path / "repo"
    work.mkdir()
    (work / "hello.py").write_text("print('hello')\n")
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run([*git, *args], cwd=work, check=True)
    (tmp_path / "home").mkdir()
    return work


def run(cli: str, *args: str, cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess:
    home = str(cwd.parent / "home")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_"))}
    env = {**base, "HOME": home, "PWD": str(cwd), **env}  # opencode takes its directory from PWD, not the cwd
    return subprocess.run([str(CLIS / cli), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def events(server: ServerProcess) -> list[dict[str, Any]]:
    out = []
    for line in server.output().splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def since(server: ServerProcess, mark: int) -> list[dict[str, Any]]:
    return events(server)[mark:]


def assert_all_accepted(evs: list[dict[str, Any]], n_requests: int) -> None:
    """Every turn request the client sent was started and finished; none was refused."""
    refused = [e for e in evs if e.get("event") == "request_error"]
    assert not refused, refused
    assert sum(e.get("event") == "request_start" for e in evs) == n_requests
    assert sum(e.get("event") == "turn_done" for e in evs) == n_requests


def claude(server: ServerProcess, repo: Path, *args: str) -> dict[str, Any]:
    env = {"ANTHROPIC_BASE_URL": server.base, "ANTHROPIC_API_KEY": "sk-test",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "IS_SANDBOX": "1"}
    done = run("claude", "-p", *args, "--output-format", "json", cwd=repo, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return json.loads(done.stdout)


def test_claude_code_runs_and_a_resumed_conversation_reads_its_prompt_from_cache(server, repo):
    mark = len(events(server))
    first = claude(server, repo, "Reply with one word: hello")
    assert first["is_error"] is False and first["terminal_reason"] == "completed", first
    assert first["result"].strip()
    resumed = claude(server, repo, "Now reply with one word: bye", "--resume", first["session_id"])
    assert resumed["is_error"] is False, resumed
    usage = resumed["usage"]
    prompt = usage["input_tokens"] + usage["cache_read_input_tokens"]
    assert usage["cache_read_input_tokens"] >= 0.9 * prompt, usage
    evs = since(server, mark)
    assert_all_accepted(evs, first["num_turns"] + resumed["num_turns"])
    starts = [e for e in evs if e.get("event") == "request_start"]
    assert all(e["path"] == "/v1/messages" and e["stream"] and e["tools"] for e in starts)
    assert starts[0]["prompt_n"] > 8000  # the whole agent prompt, tools included, in the 16K context
    assert any(e.get("event") == "max_tokens_clamped" and e["asked"] == 128000 for e in evs)


def test_codex_exec_completes_a_turn(server, repo, tmp_path):
    codex_home = tmp_path / "codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(
        'model = "specgate"\nmodel_provider = "specgate"\nmodel_context_window = 16384\n'
        "[model_providers.specgate]\n"
        f'name = "SpecGate"\nbase_url = "{server.base}/v1"\nenv_key = "SPECGATE_API_KEY"\nwire_api = "responses"\n')
    mark = len(events(server))
    done = run("codex", "exec", "--json", "--skip-git-repo-check", "Reply with one word: hello", cwd=repo,
               env={"CODEX_HOME": str(codex_home), "SPECGATE_API_KEY": "sk-test"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    kinds = [x["type"] for x in lines]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, lines
    assert any(x["type"] == "item.completed" and x["item"]["type"] == "agent_message" and x["item"]["text"]
               for x in lines)
    evs = since(server, mark)
    assert_all_accepted(evs, 1)
    start = next(e for e in evs if e.get("event") == "request_start")
    assert start["path"] == "/v1/responses" and start["tools"]


def test_opencode_runs_its_title_request_beside_the_turn(server, repo):
    (repo / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"specgate": {"npm": "@ai-sdk/openai-compatible", "name": "SpecGate",
                                  "options": {"baseURL": f"{server.base}/v1", "apiKey": "sk-test"},
                                  "models": {"specgate": {"name": "SpecGate",
                                                          "limit": {"context": 16384, "output": 4096}}}}}}))
    mark = len(events(server))
    done = run("opencode", "run", "-m", "specgate/specgate", "Reply with one word: hello", cwd=repo, env={})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "error" not in done.stdout.lower(), done.stdout[-2000:]
    evs = since(server, mark)
    assert_all_accepted(evs, 2)  # the title request and the turn, sent at once with one x-session-id
    starts = [e for e in evs if e.get("event") == "request_start"]
    assert sorted(e["tools"] for e in starts) == [False, True]
