#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what is missing, builds every binary
# the integration tests run, then runs the whole workspace's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
cargo build --workspace --bins --examples
cargo test --workspace --no-fail-fast -- --test-threads 2
