#!/usr/bin/env bash
# The server on a GPU (issue 25): `exspec serve` over a synthetic pair (bench/synthetic.py), bf16, its forwards
# captured as CUDA graphs, the default policy (A) against speculation off (B, k = 0), a burst then Poisson arrivals
# at 4 and 16 requests/s, a fresh server per round and side (scripts/loadtest_ab.sh), then the comparison: TTFT, ITL,
# end-to-end latency and throughput. NOT YET RUN ON A GPU (scripts/gpu_check.sh's loadtest-1b stage runs it).
#
#   scripts/gpu_loadtest.sh OUT_DIR [SHAPE]        SHAPE: a synthetic pair (default 1b)
#
# Environment: PYTHON (default .venv/bin/python if present, else python3); GPU_CHECK_SYNTHETIC_CACHE (default
# /tmp/exspec-synthetic); SERVE_FLAGS (default "--dtype bfloat16 --compile --compile-mode cudagraph"; on the CPU
# e.g. "--no-calibrate"); ROUNDS (1), RATES ("inf 4 16"), NUM_PROMPTS (64), MAX_TOKENS (64), DEVICE (cuda), PORT.
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: scripts/gpu_loadtest.sh OUT_DIR [SHAPE]}
shape=${2:-1b}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
cache=${GPU_CHECK_SYNTHETIC_CACHE:-/tmp/exspec-synthetic}
SERVE_FLAGS=${SERVE_FLAGS---dtype bfloat16 --compile --compile-mode cudagraph}
DEVICE=${DEVICE:-cuda}
mkdir -p "$out"
# the pair: built once into the cache (seconds on a GPU), its two folders printed on the last line
pair=$("$PYTHON" - "$shape" "$cache" "$DEVICE" <<'PY' | tail -1
import sys
from pathlib import Path

from exspec.bench.synthetic import ensure_synthetic_pair

target, draft, _ = ensure_synthetic_pair(sys.argv[1], Path(sys.argv[2]), device=sys.argv[3],
                                         log=lambda m: print(m, file=sys.stderr))
print(target, draft)
PY
) || exit 1
read -r target draft <<<"$pair"
[ -d "$target" ] && [ -d "$draft" ] || { echo "gpu_loadtest: no synthetic $shape pair (got: $pair)" >&2; exit 1; }
flags="--model $target --draft-model $draft --device $DEVICE $SERVE_FLAGS"
A_FLAGS="$flags" B_FLAGS="$flags --num-speculative-tokens 0" ROUNDS=${ROUNDS:-1} RATES=${RATES:-inf 4 16} \
  PYTHON=$PYTHON bash scripts/loadtest_ab.sh "$out" --tokenizer "$target" --ignore-eos \
  --max-tokens "${MAX_TOKENS:-64}" --num-prompts "${NUM_PROMPTS:-64}"
