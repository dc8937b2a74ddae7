#!/usr/bin/env bash
# Creates .venv (once) and installs exspec with its test extra into it.
# On a machine without CUDA it installs the CPU build of torch first (pinned), so the
# project's own torch range is already met and pip never downloads CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.exspec-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && [ -z "${EXSPEC_CPU_TORCH:-}" ]; then
      .venv/bin/python -m pip install -q "torch==2.13.0"
    else
      # CPU build: a local wheel or the CPU index configured for pip on this machine.
      .venv/bin/python -m pip install -q "torch==2.13.0" ${EXSPEC_TORCH_INDEX:+--index-url "$EXSPEC_TORCH_INDEX"}
    fi
  fi
  .venv/bin/python -m pip install -q -e ".[test,bench]"
  touch "$stamp"
fi
