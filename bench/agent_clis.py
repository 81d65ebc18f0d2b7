"""Running the coding agents people use, unchanged apart from their documented base-URL
settings, headless in a scratch git repository with a fresh home: Claude Code (``claude -p``,
Anthropic Messages), Codex CLI (``codex exec``, Responses) and opencode (``opencode run``,
Chat Completions), at the versions ``ops/setup.sh --test`` pins in ``.clis/``.  Shared by
``tests/integration/test_agent_clis.py`` and ``specgate bench coding_agents``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLIS = ROOT / ".clis" / "node_modules" / ".bin"
NAMES = ("claude", "codex", "opencode")


def missing() -> list[str]:
    """The CLIs ``.clis/`` lacks (``bash ops/setup.sh --test`` installs them)."""
    return [str(CLIS / name) for name in NAMES if not (CLIS / name).exists()]


def scratch_repo(parent: Path) -> Path:
    """A git repository with one commit under ``parent``, and a home of its own beside it."""
    work = parent / "repo"
    work.mkdir(parents=True)
    (work / "hello.py").write_text("print('hello')\n")
    git = ["git", "-c", "user.email=t@example.com", "-c", "user.name=t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "init"]):
        subprocess.run([*git, *args], cwd=work, check=True)
    (parent / "home").mkdir()
    return work


def scratch_env(cwd: Path, env: dict[str, str], strip: tuple[str, ...] = ("ANTHROPIC_", "OPENAI_", "CLAUDE_")) \
        -> dict[str, str]:
    """This process's environment without the agents' own settings (``strip``), with the
    scratch home beside ``cwd`` and ``env`` on top; opencode takes its directory from PWD."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(strip)}
    return {**base, "HOME": str(cwd.parent / "home"), "PWD": str(cwd), **env}


def run(cli: str, *args: str, cwd: Path, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLIS / cli), *args], cwd=cwd, env=scratch_env(cwd, env), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def claude(base: str, repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``claude -p ARGS --output-format json``; its stdout is one JSON result."""
    env = {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "sk-test",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "IS_SANDBOX": "1"}
    return run("claude", "-p", *args, "--output-format", "json", cwd=repo, env=env)


def codex(base: str, repo: Path, prompt: str, n_ctx: int) -> subprocess.CompletedProcess[str]:
    """``codex exec --json PROMPT`` with a provider pointing at ``base``; stdout is JSON lines."""
    codex_home = repo.parent / "codex"
    codex_home.mkdir(exist_ok=True)
    (codex_home / "config.toml").write_text(
        f'model = "specgate"\nmodel_provider = "specgate"\nmodel_context_window = {n_ctx}\n'
        "[model_providers.specgate]\n"
        f'name = "SpecGate"\nbase_url = "{base}/v1"\nenv_key = "SPECGATE_API_KEY"\nwire_api = "responses"\n')
    return run("codex", "exec", "--json", "--skip-git-repo-check", prompt, cwd=repo,
               env={"CODEX_HOME": str(codex_home), "SPECGATE_API_KEY": "sk-test"})


def opencode(base: str, repo: Path, prompt: str, n_ctx: int) -> subprocess.CompletedProcess[str]:
    """``opencode run -m specgate/specgate PROMPT`` with ``opencode.json`` pointing at ``base``."""
    (repo / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"specgate": {"npm": "@ai-sdk/openai-compatible", "name": "SpecGate",
                                  "options": {"baseURL": f"{base}/v1", "apiKey": "sk-test"},
                                  "models": {"specgate": {"name": "SpecGate",
                                                          "limit": {"context": n_ctx, "output": 4096}}}}}}))
    return run("opencode", "run", "-m", "specgate/specgate", prompt, cwd=repo, env={})


def launch(base: str, repo: Path, agent: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``specgate launch AGENT ARGS`` against ``base``: the agent set up from the server's
    ``/v1/models`` alone, in its private config folder under the scratch home."""
    env = scratch_env(repo, {"IS_SANDBOX": "1"}, ("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_", "OPENCODE_"))
    cmd = [str(ROOT / ".venv" / "bin" / "specgate"), "launch", "--url", base, "--api-key", "sk-test", agent, *args]
    return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900,
                          stdin=subprocess.DEVNULL)


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among ``text``'s lines (a CLI's ``--json`` output, a server's log)."""
    out = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue
    return out


def codex_reply(lines: list[dict[str, Any]]) -> str:
    """The agent's message text in ``codex exec --json`` output ('' when it gave none)."""
    return next((x["item"]["text"] for x in lines
                 if x.get("type") == "item.completed" and x["item"].get("type") == "agent_message"), "")
