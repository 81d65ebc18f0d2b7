#!/usr/bin/env bash
# Set up SpecGate on a fresh machine.
#   bash ops/setup.sh          .venv with SpecGate (llama-cpp-python builds from source, ~10 min the
#                              first time, cached by pip afterwards) and the default models
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
if [ "$mode" = "--test" ]; then
  echo "== installing specgate with test extras (first llama-cpp-python build takes ~10 min)"
  .venv/bin/python -m pip install "${PIP_FLAGS[@]}" -e '.[test]'
  install_redis
else
  echo "== installing specgate (first llama-cpp-python build takes ~10 min)"
  .venv/bin/python -m pip install "${PIP_FLAGS[@]}" -e .
fi
echo "== fetching models"
.venv/bin/specgate fetch-models
