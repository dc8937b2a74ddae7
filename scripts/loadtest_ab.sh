#!/usr/bin/env bash
# Interleaved load-test A/B (docs/BENCHMARKS.md, "The server under load"): the default server against speculation
# off, a burst of 64 then Poisson 4 req/s, three rounds, a fresh server per round and mode.
#   bash scripts/loadtest_ab.sh REFERENCE.jsonl OUT_DIR      (write the reference with exspec bench --write-reference)
set -u
cd "$(dirname "$0")/.."
ref=$1; out=$2; mkdir -p "$out"
for r in 1 2 3; do
  for mode in default k0; do
    extra=""; [ $mode = k0 ] && extra="--num-speculative-tokens 0"
    .venv/bin/exspec serve --port 8011 --log-level warning $extra > "$out/serve.log" 2>&1 &
    pid=$!
    for i in $(seq 60); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
    for rate in inf 4; do
      load=$(cut -d' ' -f1 /proc/loadavg)
      .venv/bin/python -m exspec.loadtest --base-url http://127.0.0.1:8011/v1 --reference "$ref" \
        --request-rate $rate --no-progress --output "$out/$mode-$rate-$r.json" > /dev/null 2>&1
      echo "$r $mode rate=$rate load=$load rc=$?"
    done
    kill $pid; wait $pid
  done
done
