#!/usr/bin/env bash
# The README's test command run again and again (docs/BENCHMARKS.md section 8): QUIET runs on the machine as it
# is, then BUSY runs with one busy loop per core (started before the run, stopped after it), so that a test which
# races the clock shows up on a fast machine and on a loaded one. One line per run: exit status, counts, seconds,
# load before and after; each run's output in OUT_DIR.
#   bash scripts/suite_runs.sh OUT_DIR          (QUIET=5 BUSY=3 by default)
set -u
cd "$(dirname "$0")/.."
out=${1:?usage: suite_runs.sh OUT_DIR}; mkdir -p "$out"
QUIET=${QUIET:-5}; BUSY=${BUSY:-3}
cores=$(nproc)
spinners=()
stop_spinners() { for pid in "${spinners[@]}"; do kill "$pid" 2>/dev/null; done; spinners=(); }
trap stop_spinners EXIT
run() {  # run NAME
  local name=$1 load0 t0 rc summary
  load0=$(cut -d' ' -f1 /proc/loadavg); t0=$(date +%s)
  bash scripts/bootstrap.sh --test > "$out/$name.log" 2>&1 && .venv/bin/python -m pytest -q -n 2 --dist loadfile >> "$out/$name.log" 2>&1
  rc=$?
  summary=$(grep -E '^[0-9]+ (passed|failed)|^=+ .*(passed|failed).* =+$' "$out/$name.log" | tail -1 | tr -d '=')
  echo "$name rc=$rc $(($(date +%s) - t0)) s load ${load0} -> $(cut -d' ' -f1 /proc/loadavg) $(date -u +%H:%M) UTC:$summary"
}
echo "commit $(git rev-parse --short HEAD), $cores cores, $(date -u +%F)"
for i in $(seq "$QUIET"); do run "quiet-$i"; done
for i in $(seq "$BUSY"); do
  for _ in $(seq "$cores"); do python3 -c "while True: pass" & spinners+=($!); done
  run "busy-$i"
  stop_spinners
done
