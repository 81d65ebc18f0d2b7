"""``specgate launch`` (cli/launch.py): what each agent is handed, from a server's /v1/models."""

from __future__ import annotations

import json
import socket
import stat
import tomllib
from pathlib import Path

import pytest

from cli import launch
from core.errors import ConfigError

INFO = launch.ServerInfo("http://127.0.0.1:8080", "specgate", 32768, 32768)


def test_claude_code_compacts_at_three_quarters_of_the_real_window_through_its_floor():
    env = launch.claude(INFO, "sk-1", Path("/unused")).env
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:8080" and env["ANTHROPIC_API_KEY"] == "sk-1"
    window, pct = int(env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"]), int(env["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"])
    assert window == 100_000  # Claude Code's floor: a lower value is read as 100,000
    assert window * pct / 100 <= 0.75 * 32768 < window * (pct + 1) / 100
    big = launch.claude(launch.ServerInfo("http://h:1", "m", 131072, 4096), "k", Path("/unused")).env
    assert big["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "131072" and big["CLAUDE_AUTOCOMPACT_PCT_OVERRIDE"] == "75"


def test_codex_and_opencode_get_the_window_in_a_private_folder(tmp_path):
    codex = launch.codex(INFO, "sk-1", tmp_path / "codex")
    assert codex.env == {"CODEX_HOME": str(tmp_path / "codex"), "SPECGATE_API_KEY": "sk-1"}
    toml = tomllib.loads(codex.files[tmp_path / "codex" / "config.toml"])
    assert toml["model_context_window"] == 32768 and toml["model_auto_compact_token_limit"] == 24576
    assert toml["model_providers"]["specgate"]["base_url"] == "http://127.0.0.1:8080/v1"
    oc = launch.opencode(INFO, "sk-1", tmp_path / "oc")
    config = json.loads(oc.files[Path(oc.env["OPENCODE_CONFIG"])])
    assert config["model"] == "specgate/specgate"
    assert config["provider"]["specgate"]["models"]["specgate"]["limit"]["context"] == 32768
    launch.write_private({**codex.files, **oc.files})
    for path in (*codex.files, *oc.files):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_no_server_is_a_clear_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=f"no SpecGate server answers at http://127.0.0.1:{port}"):
        launch.server_info(f"http://127.0.0.1:{port}/v1", "k", timeout_s=2)
