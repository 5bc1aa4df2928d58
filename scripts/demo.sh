#!/usr/bin/env bash
# Sets up, then replays a shipped trace under every policy (no GPU, no hub, no arguments).
# Arguments go to python -m simulator.replay; the engine's own demo is python -m rakv.generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec "${PYTHON:-python3}" -m simulator.replay "$@"
