#!/usr/bin/env bash
# All-reduce benchmark: rlaunch shm and tcp against torch gloo, 2 and 4 ranks, 1 KiB..256 MiB,
# all in one run. Writes results-<time>.jsonl, then table.md and busbw.png from every
# results-*.jsonl here (best time per implementation and size over the runs).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
py="$root/.venv/bin/python"
max="${MAX:-256M}"
cd "$root"
cargo build --release -p rlaunch --example allreduce_bench
out="$here/results-$(date +%Y%m%d-%H%M%S).jsonl"
: > "$out"
for n in 2 4; do
  for backend in shm tcp; do
    target/release/examples/allreduce_bench --ranks "$n" --backend "$backend" --max "$max" --json "$out"
  done
  "$py" "$here/gloo_bench.py" --ranks "$n" --max "$max" --json "$out"
done
"$py" "$here/report.py" "$here" "$here"/results-*.jsonl
