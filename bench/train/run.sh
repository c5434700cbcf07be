#!/usr/bin/env bash
# train steps/s: examples/train under rlaunch against the same model, batch and optimizer under
# PyTorch DDP (gloo) via torchrun, 2 and 4 workers, in one run. Prints the "steady:" lines.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
steps="${STEPS:-300}"
cargo build --release -p rlaunch --examples -p rlaunch-launcher
for n in 2 4; do
  echo "== world $n, batch 64/rank, $steps steps"
  target/release/rlaunch --standalone --nproc-per-node "$n" target/release/examples/train \
    --steps "$steps" --epochs 1000 --batch-size 64 --log-every 100 --no-checkpoint 2>/dev/null | grep -E "steady|done"
  OMP_NUM_THREADS=1 .venv/bin/torchrun --standalone --nproc-per-node "$n" bench/train/ddp_torch.py \
    --steps "$steps" --batch-size 64 2>/dev/null | grep steady
done
