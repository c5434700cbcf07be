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
# Every test binary first. Then the tests that mostly wait (a minute under packet loss on a
# host's link; Slurm's time limit, checked every 30 s) run in a process of their own beside the
# rest: they use little CPU, and in the rest's two slots they held one for over six minutes. The
# docker and pip tests run cargo (docker/build.sh, maturin), which may relink the binaries other
# tests start: they run last, alone, as before.
no_run=$(cargo test --workspace --no-run 2>&1) || { echo "$no_run" >&2; exit 1; }
integration=$(echo "$no_run" | sed -n 's/.*Executable tests\/main.rs (\(.*\))/\1/p')
case "$integration" in /*) ;; *) integration="$PWD/$integration" ;; esac
[ -x "$integration" ] || { echo "test.sh: cannot find the integration test binary" >&2; exit 1; }
waiting=(
  detector::five_percent_loss_on_a_hosts_link_for_a_minute_loses_no_node
  detector::fifteen_percent_loss_on_a_hosts_link_for_a_minute_loses_no_node
  detector::thirty_percent_loss_on_a_hosts_link_for_a_minute_loses_no_node
  detector::loss_between_the_rendezvous_and_one_node_is_outvoted_by_the_probes_and_shown
  etcd_multinode::on_etcd_a_lossy_link_and_a_short_blackout_lose_no_node
  slurm::at_the_time_limit_the_warning_reaches_the_workers_then_the_job_stops_leaving_nothing
)
alone=(replicated_rendezvous_in_containers_survives_losing_a_replica the_wheel_installs_both_commands)
expected=$(cd integration-tests && "$integration" --list --exact "${waiting[@]}" 2>/dev/null | grep -c ': test$' || true)
[ "$expected" -eq "${#waiting[@]}" ] || { echo "test.sh: $expected of ${#waiting[@]} waiting tests found" >&2; exit 1; }
waiting_log=$(mktemp)
(cd integration-tests && exec "$integration" --exact --test-threads "$expected" "${waiting[@]}") >"$waiting_log" 2>&1 &
waiting_pid=$!
trap 'kill "$waiting_pid" 2>/dev/null || true; rm -f "$waiting_log"' EXIT
skip=()
for t in "${waiting[@]}" "${alone[@]}"; do skip+=(--skip "$t"); done
status=0
cargo test --workspace --no-fail-fast -- --test-threads 2 "${skip[@]}" || status=$?
wait "$waiting_pid" || status=1
echo "test.sh: the tests that mostly wait (run beside the rest):"
cat "$waiting_log"
grep -q "^test result: ok. $expected passed" "$waiting_log" || { echo "test.sh: not all $expected passed" >&2; status=1; }
cargo test --workspace --no-fail-fast --test docker --test pip || status=$?
exit "$status"
