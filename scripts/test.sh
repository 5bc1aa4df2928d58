#!/usr/bin/env bash
# Sets up (test extras, the SmolLM2 GGUF), then runs the whole test suite on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
exec "${PYTHON:-python3}" -m pytest "$@"
