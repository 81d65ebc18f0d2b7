#!/usr/bin/env bash
# Set up everything the tests need, then run them.
#   bash ops/test.sh           the whole suite (builds llama-cpp-python, fetches the models)
#   bash ops/test.sh --unit    the fast mode: tests/unit only, in .venv-unit, a venv without
#                              llama-cpp-python (seconds to set up, no models)
# Further arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--unit" ]; then
  shift
  bash ops/setup.sh --unit
  exec .venv-unit/bin/python -m pytest -q -p no:cacheprovider tests/unit "$@"
fi
bash ops/setup.sh --test
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
