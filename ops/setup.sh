#!/usr/bin/env bash
# Set up SpecGate on a fresh machine: venv, packages (llama-cpp-python builds from
# source, ~10 min the first time, cached by pip afterwards), models, and with
# --test also the test extras and a redis-server binary.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "--test" ] && want_test=1

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "== creating .venv"
  "$PY" -m venv .venv
fi
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
.venv/bin/python -m pip install --quiet --disable-pip-version-check --upgrade pip
if [ "$want_test" = 1 ]; then
  echo "== installing specgate with test extras (first llama-cpp-python build takes ~10 min)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e '.[test]'
  if ! command -v redis-server >/dev/null 2>&1; then
    echo "== installing redis-server"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
  fi
else
  echo "== installing specgate (first llama-cpp-python build takes ~10 min)"
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -e .
fi
echo "== fetching models"
.venv/bin/specgate fetch-models
