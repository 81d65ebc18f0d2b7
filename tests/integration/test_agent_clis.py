"""The coding agents people run, unchanged apart from their documented base-URL settings,
headless against a real ``specgate serve``: Claude Code (Anthropic Messages), Codex CLI
(Responses) and opencode (Chat Completions), at the versions ``ops/setup.sh --test``
pins in ``.clis/``, each in a scratch git repository with a fresh home.

The target is the real Qwen2.5-Coder-0.5B, scored by its 2-block cut: the smallest model
here that ends its replies.  A truncated tiny model runs every reply to ``max_tokens``, and
Claude Code answers a ``max_tokens`` stop by asking to continue, four times, then gives up
("exceeded the 128000 output token maximum"), so no CLI run could end cleanly on one.
Each agent's prompt is 6-12K tokens, so the server runs with a 16K context.

Every run goes through ``specgate launch``, the way the README starts them: one cold prefill
of each agent's prompt is most of this file's time on a 2-core CPU, so the by-hand settings
(docs/api.md) are driven by ``specgate bench coding_agents`` instead of a second set of runs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from bench import agent_clis
from core.models import model_files
from tests.support import ServerProcess, real_model

pytestmark = pytest.mark.agents
N_CTX = 16384


@pytest.fixture(scope="module")
def server(tiny_speculator: Path):
    if gone := agent_clis.missing():
        pytest.fail(f"{gone} missing: `bash ops/setup.sh --test` installs the agent CLIs")
    srv = ServerProcess(real_model(model_files.SPECULATOR), tiny_speculator, "--n-ctx", str(N_CTX),
                        "--scorer", "speculator-full", "--keepalive-s", "5")
    yield srv
    srv.stop()


@pytest.fixture()
def repo(tmp_path: Path) -> Path:
    return agent_clis.scratch_repo(tmp_path)


def events(server: ServerProcess) -> list[dict[str, Any]]:
    return agent_clis.json_lines(server.output())


def since(server: ServerProcess, mark: int) -> list[dict[str, Any]]:
    return events(server)[mark:]


def assert_all_accepted(evs: list[dict[str, Any]], n_requests: int) -> None:
    """Every turn request the client sent was started and finished; none was refused."""
    refused = [e for e in evs if e.get("event") == "request_error"]
    assert not refused, refused
    assert sum(e.get("event") == "request_start" for e in evs) == n_requests
    assert sum(e.get("event") == "turn_done" for e in evs) == n_requests


def launched(server: ServerProcess, repo: Path, agent: str, *args: str) -> str:
    done = agent_clis.launch(server.base, repo, agent, *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    folder = repo.parent / "home" / ".cache" / "specgate" / "launch" / agent
    assert agent == "claude" or (folder.stat().st_mode & 0o777) == 0o700
    return done.stdout


def claude(server: ServerProcess, repo: Path, prompt: str, *args: str) -> dict[str, Any]:
    return json.loads(launched(server, repo, "claude", "-p", prompt, "--output-format", "json", *args))


def test_claude_code_runs_and_a_resumed_conversation_reads_its_prompt_from_cache(server, repo):
    """Claude Code set up by ``specgate launch`` from /v1/models alone: its turns are served
    with their tools, and a resumed conversation reads its prompt from the session's KV."""
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
    # launch hands Claude Code the server's output limit (by hand it asks 128000); the room left
    # in the window may still clamp it
    limit = httpx.get(server.base + "/v1/models", timeout=10).json()["data"][0]["max_output_tokens"]
    asked = {e["asked"] for e in evs if e.get("event") == "max_tokens_clamped"}
    assert asked <= {limit} and limit < 128000, (asked, limit)


def test_codex_exec_completes_a_turn(server, repo):
    mark = len(events(server))
    lines = agent_clis.json_lines(launched(server, repo, "codex", "exec", "--json", "--skip-git-repo-check",
                                           "Reply with one word: hello"))
    kinds = [x["type"] for x in lines]
    assert "turn.completed" in kinds and "turn.failed" not in kinds, lines
    assert agent_clis.codex_reply(lines)
    codex_toml = (repo.parent / "home/.cache/specgate/launch/codex/config.toml").read_text()
    assert f"model_context_window = {4 * N_CTX}" in codex_toml  # the limit: sessions evict past the window
    assert not (repo.parent / "home" / ".codex").exists()
    evs = since(server, mark)
    assert_all_accepted(evs, 1)
    start = next(e for e in evs if e.get("event") == "request_start")
    assert start["path"] == "/v1/responses" and start["tools"]


def test_opencode_runs_its_title_request_beside_the_turn(server, repo):
    mark = len(events(server))
    out = launched(server, repo, "opencode", "run", "Reply with one word: hello")
    assert "error" not in out.lower(), out[-2000:]
    assert not (repo / "opencode.json").exists()
    evs = since(server, mark)
    assert_all_accepted(evs, 2)  # the title request and the turn, sent at once with one x-session-id
    starts = [e for e in evs if e.get("event") == "request_start"]
    assert sorted(e["tools"] for e in starts) == [False, True]
    assert {e["path"] for e in starts} == {"/v1/chat/completions"}
