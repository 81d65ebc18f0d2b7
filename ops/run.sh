#!/usr/bin/env bash
# Set up, then run the gateway on the embedded defaults (in-process session store).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/setup.sh
exec .venv/bin/specgate serve "$@"
