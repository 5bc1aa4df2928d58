#!/usr/bin/env bash
# Sets up, then runs the engine on the built-in tiny pair (no GPU, no hub, no arguments).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m rakv.generate "$@"
