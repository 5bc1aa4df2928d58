#!/usr/bin/env bash
# Installs what the project needs into the active Python environment.
#   bash scripts/setup.sh          # runtime dependencies
#   bash scripts/setup.sh --test   # plus test tools, workload data, the SmolLM2 GGUF (98 MB, verified)
#                                  # and a PostgreSQL server binary (the shared Optuna study test starts its own)
# torch: a machine that already has torch (say a CUDA build) keeps it; otherwise the CPU
# build 2.13.0 is installed first, so the `torch>=2.4` requirement pulls nothing more.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  "$PY" -m pip install --quiet "torch==2.13.0"
fi
if [ "${1:-}" = "--test" ]; then
  "$PY" -m pip install --quiet -e ".[test,data]"
  "$PY" -m rakv.models fetch smollm2
  if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
      apt-get install -y -qq postgresql >/dev/null
    else
      echo "note: PostgreSQL is not installed (apt-get install postgresql): tests/test_policy.py needs it" >&2
    fi
  fi
else
  "$PY" -m pip install --quiet -e .
fi
