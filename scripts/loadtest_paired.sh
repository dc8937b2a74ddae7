#!/usr/bin/env bash
# Paired load-test A/B on a 2-core machine (docs/BENCHMARKS.md section 7): servers A and B run at the same time, each
# with its load-test client pinned to a core of its own, the cores swapped every round, so both meet the same machine
# load (on a shared VM neighbours come and go: running A, then B, as scripts/loadtest_ab.sh does, gives one of them
# the quieter minutes). Each round starts both servers fresh, waits until both answer /health, then runs BURSTS load
# tests against each at once; the files are {a,b}-{rate}-{N}.json with N = (round - 1) * BURSTS + burst, and the end
# is `python -m exspec.loadtest.compare OUT a b` (its per-round ratios are then per pair of simultaneous runs).
#   bash scripts/loadtest_paired.sh OUT_DIR [loadtest args...]
#     e.g. ... OUT --tokenizer DEMO/target --chat-template --max-tokens 64 --num-prompts 64
# Environment: A_FLAGS (""), B_FLAGS ("--num-speculative-tokens 0"), ROUNDS (2), BURSTS (3), RATE (inf),
# CORES ("0 1"), PORT (8011; B on PORT + 1), PYTHON (.venv/bin/python), STEP_TRACE (1: each server traces its steps
# to OUT/trace-{a,b}-{round}.jsonl through scripts/serve_step_trace.py; read them with its --summary).
set -u
cd "$(dirname "$0")/.."
out=$1; shift; mkdir -p "$out"
A_FLAGS=${A_FLAGS-}; B_FLAGS=${B_FLAGS---num-speculative-tokens 0}; ROUNDS=${ROUNDS:-2}; BURSTS=${BURSTS:-3}
RATE=${RATE:-inf}; PORT=${PORT:-8011}; PYTHON=${PYTHON:-.venv/bin/python}; STEP_TRACE=${STEP_TRACE:-0}
read -r -a cores <<< "${CORES:-0 1}"
healthy() {
  "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$1/health" >/dev/null 2>&1
}
declare -A core port flags=([a]=$A_FLAGS [b]=$B_FLAGS) client rc
for r in $(seq "$ROUNDS"); do
  core=([a]=${cores[$(( (r - 1) % 2 ))]} [b]=${cores[$(( r % 2 ))]}); port=([a]=$PORT [b]=$((PORT + 1)))
  pids=()
  for side in a b; do
    serve=(-m exspec serve)
    [ "$STEP_TRACE" = 1 ] && serve=(scripts/serve_step_trace.py "$out/trace-$side-$r.jsonl" serve)
    # shellcheck disable=SC2086
    taskset -c "${core[$side]}" "$PYTHON" "${serve[@]}" --port "${port[$side]}" --log-level warning ${flags[$side]} \
      > "$out/serve-$side-$r.log" 2>&1 &
    pids+=($!)
  done
  started=$SECONDS
  for _ in $(seq 720); do healthy "${port[a]}" && healthy "${port[b]}" && break; sleep 0.5; done
  echo "round $r: a on core ${core[a]}, b on core ${core[b]}; both answered /health after $((SECONDS - started)) s"
  for i in $(seq "$BURSTS"); do
    n=$(( (r - 1) * BURSTS + i )); load=$(cut -d' ' -f1 /proc/loadavg)
    for side in a b; do
      taskset -c "${core[$side]}" "$PYTHON" -m exspec.loadtest --base-url "http://127.0.0.1:${port[$side]}/v1" \
        --request-rate "$RATE" --no-progress --output "$out/$side-$RATE-$n.json" "$@" > "$out/$side-$RATE-$n.txt" 2>&1 &
      client[$side]=$!
    done
    for side in a b; do wait "${client[$side]}"; rc[$side]=$?; done
    echo "round $r burst $i ($n): load $load, rc a=${rc[a]} b=${rc[b]}"
  done
  kill "${pids[@]}"; wait "${pids[@]}"
done
echo "A = a: ${A_FLAGS:-(default flags)}; B = b: $B_FLAGS; load now $(cut -d' ' -f1-3 /proc/loadavg)"
"$PYTHON" -m exspec.loadtest.compare "$out" a b
