#!/usr/bin/env bash
# Set up SpecGate on a fresh machine.
#   bash ops/setup.sh          .venv with SpecGate (llama-cpp-python builds from source, ~10-15 min the
#                              first time, its wheel kept per CPU flag set afterwards) and the default models
#   bash ops/setup.sh --test   the same plus the test extras, redis-server and haproxy
#   bash ops/setup.sh --unit   .venv-unit: every dependency but llama-cpp-python, the test extras and
#                              redis-server; no models (what the unit tests need, in seconds)
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
PY=${PYTHON:-python3}
PIP_FLAGS=(--quiet --disable-pip-version-check)

install_redis() {  # and haproxy: the cluster tests run the real balancer
  local missing=()
  command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
  command -v haproxy >/dev/null 2>&1 || missing+=(haproxy)
  if [ ${#missing[@]} -gt 0 ]; then
    echo "== installing ${missing[*]}"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
  fi
}

if [ "$mode" = "--unit" ]; then
  [ -x .venv-unit/bin/python ] || "$PY" -m venv .venv-unit
  echo "== installing the unit-test environment (no llama-cpp-python)"
  # the project's own dependency lists, read from pyproject.toml, less llama-cpp-python
  deps=$(.venv-unit/bin/python - <<'PYEOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
wanted = project["dependencies"] + project["optional-dependencies"]["test"]
print("\n".join(d for d in wanted if not d.startswith("llama-cpp-python")))
PYEOF
)
  mapfile -t dep_list <<< "$deps"
  .venv-unit/bin/python -m pip install "${PIP_FLAGS[@]}" "${dep_list[@]}"
  .venv-unit/bin/python -m pip install "${PIP_FLAGS[@]}" --no-deps -e .
  install_redis
  exit 0
fi

if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
CMAKE_ARGS="${CMAKE_ARGS:-} $(bash ops/cpu_flags.sh)"  # native, but never AMX (see ops/cpu_flags.sh)
export CMAKE_ARGS
.venv/bin/python -m pip install "${PIP_FLAGS[@]}" --upgrade pip

# llama-cpp-python is built once per (version, CMake flags, Python) and its wheel kept under
# ~/.cache/specgate/wheels: pip's own wheel cache ignores CMAKE_ARGS, so a wheel built on this
# machine before ops/cpu_flags.sh existed (native, with AMX) would be reused and crash.
install_llama_cpp() {
  local pin key dir stamp=.venv/.specgate-llama-build
  pin=$(.venv/bin/python - <<'PYEOF'
import tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print(next(d for d in deps if d.startswith("llama-cpp-python")))
PYEOF
)
  key=$(printf '%s\n' "$pin" "$CMAKE_ARGS" "$(.venv/bin/python -c 'import sys; print(sys.version)')" \
    | sha256sum | cut -c1-16)
  [ "$(cat "$stamp" 2>/dev/null)" = "$key" ] && return 0
  dir=${XDG_CACHE_HOME:-$HOME/.cache}/specgate/wheels/$key
  if ! compgen -G "$dir/llama_cpp_python-*.whl" >/dev/null; then
    echo "== building $pin for this CPU (~10-15 min, once per CPU flag set)"
    rm -rf "$dir.partial"
    .venv/bin/python -m pip wheel "${PIP_FLAGS[@]}" --no-cache-dir --no-deps -w "$dir.partial" "$pin"
    rm -rf "$dir" && mv "$dir.partial" "$dir"
  fi
  .venv/bin/python -m pip install "${PIP_FLAGS[@]}" --force-reinstall --no-deps "$dir"/llama_cpp_python-*.whl
  echo "$key" > "$stamp"
}
# The coding agents the end-to-end tests drive unchanged (tests/integration/test_agent_clis.py), at pinned
# versions in .clis/.  npm 11 runs no install scripts by default: the two that fetch nothing but unpack
# a bundled binary are run by hand.
AGENT_CLIS=(@anthropic-ai/claude-code@2.1.328 @openai/codex@0.169.0 opencode-ai@1.18.33)
install_agent_clis() {
  local stamp=.clis/.specgate-clis
  [ "$(cat "$stamp" 2>/dev/null)" = "${AGENT_CLIS[*]}" ] && return 0
  command -v npm >/dev/null 2>&1 || { echo "setup: npm is needed for the agent CLI tests (apt-get install npm)"; exit 1; }
  echo "== installing the agent CLIs: ${AGENT_CLIS[*]}"
  npm install --prefix .clis --no-audit --no-fund --loglevel=error "${AGENT_CLIS[@]}" >/dev/null
  (cd .clis/node_modules/@anthropic-ai/claude-code && node install.cjs >/dev/null)
  (cd .clis/node_modules/opencode-ai && node ./postinstall.mjs >/dev/null)
  echo "${AGENT_CLIS[*]}" > "$stamp"
}

install_llama_cpp
if [ "$mode" = "--test" ]; then
  echo "== installing specgate with test extras"
  .venv/bin/python -m pip install "${PIP_FLAGS[@]}" -e '.[test]'
  install_redis
  install_agent_clis
else
  echo "== installing specgate"
  .venv/bin/python -m pip install "${PIP_FLAGS[@]}" -e .
fi
echo "== fetching models"
.venv/bin/specgate fetch-models
