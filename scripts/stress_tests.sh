#!/usr/bin/env bash
# Runs the test suite STRESS_RUNS times in a row (default 5) while STRESS_HOGS busy processes
# (default 1) load the CPU, and stops at the first failing run. A suite that passes here does not
# depend on timing. Arguments go to pytest (default: tests), e.g. `scripts/stress_tests.sh tests/unit`.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${STRESS_RUNS:-5}
hogs=${STRESS_HOGS:-1}
[ $# -gt 0 ] || set -- tests

hog_pids=()
stop_hogs() { for pid in "${hog_pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_hogs EXIT
for _ in $(seq "$hogs"); do
  timeout 4h python3 -c 'while True: pass' &  # bounded even if this script is killed
  hog_pids+=($!)
done

for run in $(seq "$runs"); do
  echo "== run $run of $runs, $hogs busy process(es) loading the CPU =="
  if ! .venv/bin/python -m pytest -q "$@"; then
    echo "stress_tests: run $run of $runs failed" >&2
    exit 1
  fi
done
echo "stress_tests: all $runs runs passed"
