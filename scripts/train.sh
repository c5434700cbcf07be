#!/usr/bin/env bash
# The README's first command: on a machine with only Rust and apt, installs what the build
# needs, builds the binaries and the `train` example (release), and runs a standalone
# data-parallel training job of 4 workers. Extra arguments go to `train` (default: --epochs 3).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh --build
cargo build --release --workspace --bins --examples
[ $# -gt 0 ] || set -- --epochs 3
exec target/release/rlaunch --standalone --nproc-per-node 4 target/release/examples/train "$@"
