#!/usr/bin/env bash
# exspec's GPU check (issue 20 item 4; run by the GPU issue): on a CUDA machine with this repository and no network,
# within a 10-minute budget, run the GPU tests (the Triton kernel compiled, the triton backend's engine tests), bf16
# equivalence on the four test architectures, the synthetic pairs' agreement, compile (CUDA graph capture) on against
# off end to end, the step profile (eager and captured), the 8b pair's speed (eager and captured, fixed k), the paged
# kernel's benchmark and the synthetic 1b and 8b `exspec bench` tables (the target alone, fixed k and exspec's own
# policy), writing logs, JSON and Markdown into one folder. All of it takes about two 10-minute calls: split them with
# GPU_CHECK_SKIP.
#
#   scripts/gpu_check.sh [--dry-run] [OUT_DIR]
#
# OUT_DIR: the argument, else $OUT when set (the device tool's output folder), else gpu-results/<UTC timestamp>.
# The summary is OUT_DIR/summary.md, each stage's status and seconds OUT_DIR/stages.jsonl. --dry-run prints the plan
# (stages, limits, commands) and runs nothing: it works on any machine.
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3); GPU_CHECK_BUDGET_S (default 600: a stage
# that cannot finish inside what is left is cut to it, one with under 20 s left is skipped); GPU_CHECK_PROMPTS /
# GPU_CHECK_MAX_TOKENS (synthetic tables: prompts, new tokens per prompt; default 16 / 32); GPU_CHECK_BATCH_SIZES
# (default 1,8); GPU_CHECK_KS (default 3); GPU_CHECK_SHAPES (default 1b:180,8b:240: the synthetic
# tables' pairs and stage limits); GPU_CHECK_AGREEMENT_SCALES (the scales swept by scripts/synthetic_agreement.py);
# GPU_CHECK_SKIP (stage names not to run, comma-separated); GPU_CHECK_BENCH_METHODS (the bench stages' --methods);
# GPU_CHECK_BENCH_COMPILE (the bench stages' --compile-mode:
# cudagraph (default), inductor, or off for eager); GPU_CHECK_PROFILE_CONFIGS (profile-compiled's B:k list, default
# 1:0,1:2,8:2); GPU_CHECK_WHEELS (default: .whl): a folder of wheels
# installed into /tmp/exspec-site before anything runs, see docs/GPU.md.
#
# Ran on an H100 on 2026-11-24 (docs/BENCHMARKS.md section 0), in four calls, stage by stage: the limits below are
# those runs' times with room (kernel tests 87 s, bf16 40 s but 61 s on a fresh machine on 2026-11-27, agreement 23 s,
# a compile-check bucket about 30 s to compile, the 8b pair about 60 s to build and each captured 8b configuration
# 40-70 s). On 2026-11-27 (15 minutes of device time): kernel tests 70 s, gpu-tests 52 s, compile-check-cudagraph 36 s,
# profile-eager 47-60 s. The bench and loadtest stages, first run on 2026-11-27 (third session, one warm machine):
# bench-1b 101 s with its pair already built (B = 1, 8, 16 prompts; with B = 1, 8, 32 and 32 prompts it did not fit
# 180 s), bench-8b 191 s building the 8b pair, loadtest-1b 192 s. They run last.
# On an H200 on 2026-11-28 (fresh machine): kernel tests 86 s, gpu-tests 68 s, bf16 51 s, bench-1b 45 s (3 methods,
# building the pair), loadtest-1b 81 s with RATES=16; scripts/gpu_loadtest.sh 8b with RATES="inf 4" 203 s.
set -uo pipefail
cd "$(dirname "$0")/.."

DRY_RUN=0
if [ "${1:-}" = "--dry-run" ]; then
    DRY_RUN=1
    shift
fi
OUT_DIR=${1:-${OUT:-gpu-results/$(date -u +%Y%m%dT%H%M%SZ)}}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
BUDGET=${GPU_CHECK_BUDGET_S:-600}
PROMPTS=${GPU_CHECK_PROMPTS:-16}
MAX_TOKENS=${GPU_CHECK_MAX_TOKENS:-32}
BATCH_SIZES=${GPU_CHECK_BATCH_SIZES:-1,8}
KS=${GPU_CHECK_KS:-3}
SHAPES=${GPU_CHECK_SHAPES:-1b:180,8b:240}  # the synthetic tables: NAME:LIMIT_S, comma-separated
SKIP=${GPU_CHECK_SKIP:-}  # stage names not to run, comma-separated
BENCH_COMPILE_MODE=${GPU_CHECK_BENCH_COMPILE:-cudagraph}  # the bench stages' --compile-mode, or off
BENCH_METHODS=${GPU_CHECK_BENCH_METHODS:-target-ar,exspec-fixed,exspec,hf-generate,hf-assisted}
PROFILE_CONFIGS=${GPU_CHECK_PROFILE_CONFIGS:-1:0,1:2,8:2}  # profile-compiled's configurations, B:k
AGREEMENT_SCALES=${GPU_CHECK_AGREEMENT_SCALES:-0.01,0.012,0.015}
WHEELS=${GPU_CHECK_WHEELS:-.whl}
SYNTHETIC_CACHE=${GPU_CHECK_SYNTHETIC_CACHE:-/tmp/exspec-synthetic}
STARTED=$SECONDS

if [ $DRY_RUN = 0 ]; then
    mkdir -p "$OUT_DIR"
    STAGES="$OUT_DIR/stages.jsonl"
    : >"$STAGES"
    # Wheels brought along (docs/GPU.md): fastapi, uvicorn, pydantic-settings and their needs, then exspec itself,
    # into a folder of their own, so the machine's torch, triton and transformers stay as they are.
    if [ -d "$WHEELS" ] && ls "$WHEELS"/*.whl >/dev/null 2>&1; then
        SITE=/tmp/exspec-site
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
            "$WHEELS"/*.whl >"$OUT_DIR/wheels.log" 2>&1 || echo "gpu_check: installing $WHEELS failed (see wheels.log)" >&2
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: no CUDA device visible to $PYTHON; nothing run (--dry-run prints the plan)." >&2
        exit 2
    fi
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # this checkout imports as exspec (exspec/__init__.py)
    if ! "$PYTHON" -c "import exspec.engine" 2>/dev/null; then  # not importable: a copy of this checkout, no deps
        SITE=${SITE:-/tmp/exspec-site}
        "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" . \
            >>"$OUT_DIR/wheels.log" 2>&1 || echo "gpu_check: installing exspec failed (see wheels.log)" >&2
        export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    fi
    unset TRITON_INTERPRET  # the kernels must compile for the GPU, not run in Triton's interpreter
fi

# stage NAME LIMIT_S CMD...: runs CMD with its output in OUT_DIR/NAME.log, under the smaller of LIMIT_S and what is
# left of the budget; records status and seconds.
stage() {
    local name=$1 limit=$2
    shift 2
    local left=$((BUDGET - (SECONDS - STARTED)))
    if [[ ",$SKIP," == *",$name,"* ]]; then
        skip "$name" "GPU_CHECK_SKIP"
        return
    fi
    if [ $DRY_RUN = 1 ]; then
        printf '%-22s %4ss  %s\n' "$name" "$limit" "$*"
        return
    fi
    if [ $left -lt 20 ]; then
        skip "$name" "out of budget (${BUDGET}s)"
        return
    fi
    [ $limit -gt $left ] && limit=$left
    local start=$SECONDS
    echo "== $name (limit ${limit}s): $*" >&2
    timeout --kill-after=10 "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    local rc=$? status=ok
    [[ $rc -ne 0 ]] && status=failed
    [[ $rc -eq 124 || $rc -eq 137 ]] && status=timeout
    [[ $rc -eq 5 && "$*" == *pytest* ]] && status="no tests selected"
    printf '{"stage": "%s", "status": "%s", "rc": %d, "seconds": %d, "limit": %d, "command": "%s"}\n' \
        "$name" "$status" "$rc" $((SECONDS - start)) "$limit" "$*" >>"$STAGES"
    echo "   -> $status ($((SECONDS - start)) s)" >&2
}

skip() {  # skip NAME REASON
    if [ $DRY_RUN = 1 ]; then
        printf '%-22s skip   %s\n' "$1" "$2"
        return
    fi
    printf '{"stage": "%s", "status": "skipped: %s", "rc": -1, "seconds": 0, "limit": 0, "command": ""}\n' "$1" "$2" >>"$STAGES"
    echo "== $1: skipped: $2" >&2
}

if [ $DRY_RUN = 1 ]; then
    echo "gpu_check plan: budget ${BUDGET}s, results into $OUT_DIR"
    HAVE_CLI=1
    HAVE_PYTEST=1
else
    # 0. The machine and the software.
    "$PYTHON" - >"$OUT_DIR/env.json" <<'EOF'
import importlib, json, platform
import torch
info = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
for name in ("triton", "transformers", "fastapi", "uvicorn", "pydantic_settings", "pytest", "pytest_asyncio"):
    try:
        info[name] = getattr(importlib.import_module(name), "__version__", "present")
    except ImportError:
        info[name] = None
print(json.dumps(info, indent=1))
EOF
    nvidia-smi >"$OUT_DIR/nvidia-smi.txt" 2>&1 || true
    HAVE_CLI=$("$PYTHON" -c "import pydantic_settings, fastapi, uvicorn; print(1)" 2>/dev/null || echo 0)
    HAVE_PYTEST=$("$PYTHON" -c "import pytest; print(1)" 2>/dev/null || echo 0)
fi
PYTEST=("$PYTHON" -m pytest -q -p no:cacheprovider)

# 1. Tests: the Triton kernel compiled for the GPU, every test marked `gpu` (and logprobs on the device), bf16
#    equivalence on the four architectures on the GPU (tests/engine/test_engine_bf16.py runs all four where CUDA is).
if [ "$HAVE_PYTEST" = 1 ]; then
    stage kernel-tests 100 "${PYTEST[@]}" tests/engine/test_paged_kernel.py --junitxml "$OUT_DIR/kernel-tests.xml"
    stage gpu-tests 120 "${PYTEST[@]}" tests/engine/test_fullgraph.py tests/engine/test_attention_backends.py \
        tests/engine/test_cuda_graphs.py tests/engine/test_logprobs.py \
        --junitxml "$OUT_DIR/gpu-tests.xml"
    stage bf16-equivalence 120 "${PYTEST[@]}" tests/engine/test_engine_bf16.py --junitxml "$OUT_DIR/bf16-equivalence.xml"
else
    skip tests "pytest is not installed (docs/GPU.md: bring its wheel)"
fi

# 1b. The synthetic pairs' draft agreement against their `scale` (built in memory, nothing saved).
stage synthetic-agreement 90 "$PYTHON" scripts/synthetic_agreement.py --shapes 1b,8b --scales "$AGREEMENT_SCALES" \
    --device cuda --json "$OUT_DIR/synthetic-agreement.json"

# 2. Compile (CUDA graphs through mode="reduce-overhead") on against off, end to end on the 1b synthetic pair in
#    bf16: outputs compared (near-ties only), decode throughput, compile time (scripts/compile_check.py).
stage compile-check 200 "$PYTHON" scripts/compile_check.py --synthetic 1b --synthetic-cache "$SYNTHETIC_CACHE" \
    --device cuda --dtype bfloat16 --batch-sizes 1,8 --max-tokens "$MAX_TOKENS" --out "$OUT_DIR/compile-check"
# 2a. The same with the forwards recorded into CUDA graphs directly (no compiler; compile_mode "cudagraph", not yet
#     run on a GPU): outputs against eager, capture time (the first run) against the stage above's compile time.
stage compile-check-cudagraph 120 "$PYTHON" scripts/compile_check.py --synthetic 1b \
    --synthetic-cache "$SYNTHETIC_CACHE" --device cuda --dtype bfloat16 --batch-sizes 1,8 --max-tokens "$MAX_TOKENS" \
    --compile-mode cudagraph --out "$OUT_DIR/compile-check-cudagraph"

# 2b. Where a step's time goes and its host syncs (PyTorch profiler), eager and compiled, on the 1b pair.
stage profile-eager 90 "$PYTHON" scripts/profile_gpu_step.py --synthetic 1b --synthetic-cache "$SYNTHETIC_CACHE" \
    --configs 1:0,1:2,8:2,32:2 --out "$OUT_DIR/profile-eager"
stage profile-compiled 200 "$PYTHON" scripts/profile_gpu_step.py --synthetic 1b --synthetic-cache "$SYNTHETIC_CACHE" \
    --configs "$PROFILE_CONFIGS" --compile --out "$OUT_DIR/profile-compiled"

# 2c. The 8b pair's speed: the target alone against fixed k, eager and captured (docs/BENCHMARKS.md section 0).
stage speed-8b 420 "$PYTHON" scripts/profile_gpu_step.py --synthetic 8b --synthetic-cache "$SYNTHETIC_CACHE" \
    --configs 1:0,1:3,8:3,8:0,32:2,32:0 --modes eager,compiled --no-profile --max-tokens 32 --prompt-len 256 \
    --out "$OUT_DIR/speed-8b"

# 3. The kernel alone: 8B-shaped (head_dim 128) and 1B-shaped (64) layers, decode and verify, against gather + SDPA.
stage kernel-bench-8b 60 "$PYTHON" scripts/bench_paged_kernel.py --heads 32 --kv-heads 8 --head-dim 128 \
    --json "$OUT_DIR/kernel-bench-8b.json"
stage kernel-bench-1b 60 "$PYTHON" scripts/bench_paged_kernel.py --heads 32 --kv-heads 8 --head-dim 64 \
    --json "$OUT_DIR/kernel-bench-1b.json"

# 4. The synthetic tables (needs the CLI's dependencies): per shape one run, the target alone, fixed k
#    (rows exspec-fixed-kK), exspec's own policy, Hugging Face's generate and assisted generation (B = 1; eager, as
#    a user runs them; GPU_CHECK_BENCH_METHODS), every engine's forwards captured as CUDA graphs
#    (GPU_CHECK_BENCH_COMPILE, default cudagraph: 0.1-0.2 s a batch size on an H100, where inductor compiled each
#    engine's graphs for minutes; "off": eager). One timed run per point (--repeats 1) to fit.
if [ "$HAVE_CLI" = 1 ]; then
    BENCH_COMPILE=()
    [ "$BENCH_COMPILE_MODE" != off ] && BENCH_COMPILE=(--compile --compile-mode "$BENCH_COMPILE_MODE")
    for shape_limit in ${SHAPES//,/ }; do
        shape=${shape_limit%%:*}
        stage "bench-$shape" "${shape_limit##*:}" "$PYTHON" -m exspec bench --synthetic "$shape" \
            --synthetic-cache "$SYNTHETIC_CACHE" --dtype bfloat16 --methods "$BENCH_METHODS" \
            --fixed-ks "$KS" --batch-sizes "$BATCH_SIZES" --num-prompts "$PROMPTS" --max-tokens "$MAX_TOKENS" \
            "${BENCH_COMPILE[@]}" --repeats 1 --no-progress --output "$OUT_DIR/bench-$shape"
    done
    # 5. The server on the GPU: the 1b pair served captured, the default policy against k = 0, a burst and Poisson
    #    4 and 16 requests/s (scripts/gpu_loadtest.sh; NOT YET RUN ON A GPU).
    stage loadtest-1b 420 env PYTHON="$PYTHON" GPU_CHECK_SYNTHETIC_CACHE="$SYNTHETIC_CACHE" \
        bash scripts/gpu_loadtest.sh "$OUT_DIR/loadtest-1b" 1b
else
    skip bench "fastapi / uvicorn / pydantic-settings missing (docs/GPU.md: bring their wheels)"
fi

[ $DRY_RUN = 1 ] && exit 0

# 6. One Markdown summary: the machine, each stage's status, then every table written above.
{
    echo "# exspec GPU check, $(date -u +%Y-%m-%dT%H:%MZ), $((SECONDS - STARTED)) s of a ${BUDGET} s budget"
    echo
    echo '```json'
    cat "$OUT_DIR/env.json"
    echo '```'
    echo
    echo "| stage | status | seconds | limit |"
    echo "|---|---|---|---|"
    "$PYTHON" -c "
import json, sys
for line in open(sys.argv[1]):
    s = json.loads(line)
    print(f\"| {s['stage']} | {s['status']} | {s['seconds']} | {s['limit']} |\")
" "$STAGES"
    for log in "$OUT_DIR"/kernel-bench-*.log; do
        [ -f "$log" ] || continue
        echo
        echo "## $(basename "$log" .log)"
        echo
        grep -E '^(#|\|)' "$log"
    done
    for js in "$OUT_DIR"/profile-eager/profile.json "$OUT_DIR"/profile-compiled/profile.json \
        "$OUT_DIR"/speed-8b/profile.json "$OUT_DIR"/synthetic-agreement.json; do
        [ -f "$js" ] || continue
        echo
        echo "## $(basename "$(dirname "$js")")/$(basename "$js")"
        echo
        echo '```json'
        cat "$js"
        echo '```'
    done
    for md in "$OUT_DIR"/compile-check/compile_check.md "$OUT_DIR"/compile-check-cudagraph/compile_check.md \
        "$OUT_DIR"/bench-*/results.md; do
        [ -f "$md" ] || continue
        echo
        echo "## $(basename "$(dirname "$md")")"
        echo
        cat "$md"
    done
    if [ -f "$OUT_DIR/loadtest-1b.log" ]; then
        echo
        echo "## loadtest-1b (the default policy against k = 0, served)"
        echo
        echo '```text'
        tail -n 40 "$OUT_DIR/loadtest-1b.log"
        echo '```'
    fi
} >"$OUT_DIR/summary.md"
echo "gpu_check: wrote $OUT_DIR/summary.md" >&2
