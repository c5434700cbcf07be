#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what is missing, builds the book (docs/)
# and checks the docs' links and the module rules, checks formatting and lints, builds every binary the integration
# tests run, then runs the whole workspace's tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install-deps.sh
# The book (docs/) builds and every link in it, the README and ARCHITECTURE.md resolves.
mdbook="${RLAUNCH_VENV:-.venv}/bin/mdbook"
[ -x "$mdbook" ] || { echo "test.sh: $mdbook is missing (scripts/install-deps.sh installs it)" >&2; exit 1; }
"$mdbook" build docs
python3 scripts/check-docs.py
# No import circle, nothing importing a crate root, no production file over 1,000 lines.
python3 scripts/check-modules.py
command -v rustfmt >/dev/null || rustup component add rustfmt
cargo clippy --version >/dev/null 2>&1 || rustup component add clippy
# Incremental caches double the build folder and a clean clone never reuses them.
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"
cargo fmt --all --check
cargo clippy --workspace --all-targets -- -D warnings
cargo build --workspace --bins --examples
cargo test --workspace --no-fail-fast -- --test-threads 2
