#!/usr/bin/env bash
# Interleaved load-test A/B (docs/BENCHMARKS.md): server A (default flags) against server B (speculation off),
# a burst then Poisson 4 req/s, three rounds, a fresh server per round and server; then the comparison
# (python -m exspec.loadtest.compare: per metric the medians over rounds and each round's ratio A/B).
#   bash scripts/loadtest_ab.sh OUT_DIR [loadtest args...]
#     e.g. ... OUT --reference ref64.jsonl                    (write it with exspec bench --write-reference)
#     or   ... OUT --tokenizer ~/.cache/exspec/demo/target --chat-template --max-tokens 64
# Environment: A_FLAGS (default ""), B_FLAGS (default "--num-speculative-tokens 0"), ROUNDS (3),
# RATES ("inf 4"), PORT (8011), PYTHON (default .venv/bin/python: the server runs as `$PYTHON -m exspec serve`).
set -u
cd "$(dirname "$0")/.."
out=$1; shift; mkdir -p "$out"
A_FLAGS=${A_FLAGS-}; B_FLAGS=${B_FLAGS---num-speculative-tokens 0}; ROUNDS=${ROUNDS:-3}; RATES=${RATES:-inf 4}
PORT=${PORT:-8011}; PYTHON=${PYTHON:-.venv/bin/python}
healthy() {  # the server answers /health (python, not curl: the GPU machines may have no curl)
  "$PYTHON" -c "import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)" \
    "http://127.0.0.1:$PORT/health" >/dev/null 2>&1
}
for r in $(seq "$ROUNDS"); do
  for mode in default k0; do
    flags=$A_FLAGS; [ $mode = k0 ] && flags=$B_FLAGS
    # shellcheck disable=SC2086
    "$PYTHON" -m exspec serve --port "$PORT" --log-level warning $flags > "$out/serve-$mode-$r.log" 2>&1 &
    pid=$!
    started=$SECONDS
    for _ in $(seq 720); do healthy && break; sleep 0.5; done  # a captured GPU server captures its graphs first
    echo "round $r $mode: server answered /health after $((SECONDS - started)) s"
    for rate in $RATES; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      "$PYTHON" -m exspec.loadtest --base-url "http://127.0.0.1:$PORT/v1" --request-rate "$rate" \
        --no-progress --output "$out/$mode-$rate-$r.json" "$@" > "$out/$mode-$rate-$r.txt" 2>&1
      rc=$?
      echo "round $r $mode rate=$rate load=$load rc=$rc $("$PYTHON" -c "import json,sys; m=json.load(open(sys.argv[1])); print(' '.join(f'{k}={m[k]:.1f}' for k in ('output_throughput','mean_ttft_ms','p90_ttft_ms','p50_itl_ms','p99_itl_ms','p50_e2el_ms','p90_e2el_ms')))" "$out/$mode-$rate-$r.json" 2>/dev/null)"
    done
    kill $pid; wait $pid
  done
done
echo "A = default: ${A_FLAGS:-(default flags)}; B = k0: $B_FLAGS; load now $(cut -d' ' -f1-3 /proc/loadavg)"
"$PYTHON" -m exspec.loadtest.compare "$out" default k0
