#!/usr/bin/env bash
# Set up everything the tests need, then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh --test
.venv/bin/python -m pytest -q -p no:cacheprovider "$@"
