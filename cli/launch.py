"""``specgate launch claude|codex|opencode [agent args]``: run a coding agent against a running
SpecGate, set up from what the server reports, as ``ollama launch`` does.

It reads the server's ``GET /v1/models`` (the model id, the longest prompt a turn may send --
4x the KV window by default, past which sessions evict -- and the most a reply may take)
and hands the agent the base URL, the key, the model, that window and compaction
settings through environment variables and a private config folder
(``~/.cache/specgate/launch/<agent>``, ``0700``; files ``0600``).  The user's own config
files are never read or written.  Then it runs the agent in this process's place, with the
arguments given after its name.

Compaction: an agent that compacts its conversation before it outgrows the server's limit
never gets "prompt is too long".  Codex and opencode take the window as is.  Claude Code
floors ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` at 100,000, so the window is set there and
``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE`` brings its trigger down to ``COMPACT_AT`` of the
server's real window.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import ConfigError

AGENTS = ("claude", "codex", "opencode")
CLAUDE_MIN_WINDOW = 100_000  # Claude Code's floor for CLAUDE_CODE_AUTO_COMPACT_WINDOW
COMPACT_AT = 0.75  # of the window: room left for the reply and the files an agent re-reads after compacting
ROOT = Path(__file__).resolve().parents[1]


@dataclass(slots=True, frozen=True)
class ServerInfo:
    base: str  # http://host:port, without /v1
    model: str
    window: int  # tokens a request may hold
    max_output: int


@dataclass(slots=True, frozen=True)
class Launch:
    env: dict[str, str]
    files: dict[Path, str] = field(default_factory=dict)  # written into the private folder first
    args: tuple[str, ...] = ()  # before the user's own


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("agent", choices=AGENTS, help="the coding agent to run")
    p.add_argument("agent_args", nargs=argparse.REMAINDER, help="arguments for the agent, as it takes them")
    p.add_argument("--url", default=os.environ.get("SPECGATE_URL", "http://127.0.0.1:8080"),
                   help="the server (env SPECGATE_URL; default http://127.0.0.1:8080)")
    p.add_argument("--api-key", default=os.environ.get("SPECGATE_API_KEY", "none"),
                   help="the key the agent sends (env SPECGATE_API_KEY; default: none, for a server without keys)")
    p.add_argument("--config-dir", default=None,
                   help="the private config folder (default ~/.cache/specgate/launch/AGENT)")
    p.add_argument("--print-env", action="store_true", help="print what would be set, as JSON, and run nothing")


def server_info(url: str, key: str, timeout_s: float = 10.0) -> ServerInfo:
    base = url.rstrip("/").removesuffix("/v1")
    req = urllib.request.Request(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        raise ConfigError(f"{base}/v1/models answered {exc.code}: is the key right (--api-key)?") from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise ConfigError(f"no SpecGate server answers at {base} ({exc}); start one with `specgate serve` "
                          "or name it with --url") from exc
    try:
        model = body["data"][0]
        window = int(model["context_length"])
        return ServerInfo(base, str(model["id"]), window, int(model.get("max_output_tokens", window)))
    except (KeyError, IndexError, TypeError, ValueError) as exc:
        raise ConfigError(f"{base}/v1/models does not describe a model as SpecGate does: {body!r:.200}") from exc


def claude(info: ServerInfo, key: str, folder: Path) -> Launch:
    window = max(CLAUDE_MIN_WINDOW, info.window)
    pct = max(1, min(100, int(100 * COMPACT_AT * info.window / window)))
    return Launch({"ANTHROPIC_BASE_URL": info.base, "ANTHROPIC_API_KEY": key, "ANTHROPIC_MODEL": info.model,
                   "ANTHROPIC_SMALL_FAST_MODEL": info.model, "CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(window),
                   "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": str(pct), "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(info.max_output),
                   "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})


def codex(info: ServerInfo, key: str, folder: Path) -> Launch:
    config = (f'model = "{info.model}"\nmodel_provider = "specgate"\nmodel_context_window = {info.window}\n'
              f"model_auto_compact_token_limit = {int(COMPACT_AT * info.window)}\n"
              "[model_providers.specgate]\n"
              f'name = "SpecGate"\nbase_url = "{info.base}/v1"\nenv_key = "SPECGATE_API_KEY"\nwire_api = "responses"\n')
    return Launch({"CODEX_HOME": str(folder), "SPECGATE_API_KEY": key}, {folder / "config.toml": config})


def opencode(info: ServerInfo, key: str, folder: Path) -> Launch:
    config: dict[str, Any] = {
        "$schema": "https://opencode.ai/config.json", "model": f"specgate/{info.model}",
        "provider": {"specgate": {"npm": "@ai-sdk/openai-compatible", "name": "SpecGate",
                                  "options": {"baseURL": f"{info.base}/v1", "apiKey": "{env:SPECGATE_API_KEY}"},
                                  "models": {info.model: {"name": "SpecGate", "limit": {
                                      "context": info.window, "output": min(info.max_output, 4096)}}}}}}
    path = folder / "opencode.json"
    return Launch({"OPENCODE_CONFIG": str(path), "SPECGATE_API_KEY": key}, {path: json.dumps(config, indent=2)})


SETUPS = {"claude": claude, "codex": codex, "opencode": opencode}


def binary(agent: str) -> str:
    """The agent's command: on PATH, else the copy ``ops/setup.sh --test`` pins in ``.clis/``."""
    found = shutil.which(agent) or shutil.which(agent, path=str(ROOT / ".clis" / "node_modules" / ".bin"))
    if found is None:
        raise ConfigError(f"{agent} is not installed: see the README's coding agents section")
    return found


def write_private(files: dict[Path, str]) -> None:
    for path, text in files.items():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path.parent, 0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as out:
            out.write(text)
        os.chmod(path, 0o600)


def run(args: argparse.Namespace) -> int:
    info = server_info(args.url, args.api_key)
    folder = Path(args.config_dir) if args.config_dir else Path.home() / ".cache" / "specgate" / "launch" / args.agent
    launch = SETUPS[args.agent](info, args.api_key, folder)
    extra = [a for a in args.agent_args if a != "--"]
    if args.print_env:
        print(json.dumps({"env": launch.env, "files": sorted(map(str, launch.files)), "window": info.window,
                          "args": [*launch.args, *extra]}, indent=2))
        return 0
    write_private(launch.files)
    command = binary(args.agent)
    os.execvpe(command, [command, *launch.args, *extra], {**os.environ, **launch.env})
    return 0  # not reached
