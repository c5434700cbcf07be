#!/usr/bin/env bash
# The GPU checks of issue 6 in one command, on a machine with an NVIDIA GPU (driver >= 580,
# CUDA 13): builds with `--features cuda`, then runs the ignored test `gpu_check`
# (integration-tests/tests/kernels_nvrtc.rs -> rlaunch::gpu::check::run):
#   - every kernel in kernels/cu/*.cu against its CPU reference on fresh random inputs;
#   - GPU training (fp32 and bf16) against the CPU model, through a 1-rank NCCL group;
#   - NCCL all-reduce with the 1 rank one GPU allows, bootstrapped through a real TCPStore;
#   - benchmarks: rlaunch's NCCL group vs raw ncclAllReduce (overhead %), fused update
#     kernels vs the card's device-to-device copy bandwidth, in the same run;
# and, when examples/train has `--device`, `train --device cuda` against `--device cpu` under
# rlaunch. Everything lands in bench/gpu/RESULTS.md with the device and the date.
#
# Usage: scripts/gpu-check.sh            (exit status 0 = every check passed)
# Libraries: libcuda from the driver; NVRTC 13, cuBLAS 13 and NCCL 2 from the CUDA toolkit,
# the system, PyPI wheels in .venv or in the system Python (all searched; see
# kernels/src/probe.rs). Extra directories: RLAUNCH_CUDA_LIB_DIRS=dir1:dir2.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${RLAUNCH_GPU_CHECK_OUT:-bench/gpu/RESULTS.md}
mkdir -p bench/gpu
LOG=$(mktemp -d)/gpu-check
mkdir -p "$LOG"
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)

say() { printf 'gpu-check: %s\n' "$*" >&2; }

# Cargo flags for every later call: --offline when the registry cannot be reached (GPU
# machines may be air-gapped but carry ~/.cargo's cache). Decided by the first build.
CARGO_FLAGS=()
# Release by default (the benchmarks need it); RLAUNCH_GPU_CHECK_DEBUG=1 for a quick dry run.
if [ "${RLAUNCH_GPU_CHECK_DEBUG:-0}" = 1 ]; then PROFILE=(); TDIR=target/debug; else PROFILE=(--release); TDIR=target/release; fi

if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader >&2 || true
else
  say "nvidia-smi not found: is this a GPU machine? (continuing; the probe will say what is missing)"
fi

# Library directories beyond the loader's own: PyPI wheels of the system Python, toolkits.
dirs=()
for d in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
  [ -d "$d" ] && dirs+=("$d")
done
for py in python3 .venv/bin/python; do
  command -v "$py" >/dev/null || [ -x "$py" ] || continue
  while IFS= read -r d; do [ -n "$d" ] && dirs+=("$d"); done < <(
    "$py" - <<'PY' 2>/dev/null
import glob, os, site, sys
roots = set(site.getsitepackages() + [site.getusersitepackages()])
for r in sorted(roots):
    for d in sorted(glob.glob(os.path.join(r, "nvidia", "*", "lib"))):
        print(d)
PY
  )
done
RLAUNCH_CUDA_LIB_DIRS="${RLAUNCH_CUDA_LIB_DIRS:+$RLAUNCH_CUDA_LIB_DIRS:}$(IFS=:; echo "${dirs[*]-}")"
export RLAUNCH_CUDA_LIB_DIRS
say "extra library directories: ${RLAUNCH_CUDA_LIB_DIRS:-none}"

say "building (${PROFILE[*]:-debug}, --features cuda)"
if ! cargo build "${PROFILE[@]}" -p rlaunch --features cuda; then
  say "cargo build failed; retrying with --offline"
  CARGO_FLAGS=(--offline)
  cargo build "${CARGO_FLAGS[@]}" "${PROFILE[@]}" -p rlaunch --features cuda || { say "build of rlaunch --features cuda failed"; exit 1; }
fi
cargo test "${CARGO_FLAGS[@]}" "${PROFILE[@]}" -p integration-tests --test kernels_nvrtc --no-run || { say "build of the check failed"; exit 1; }

say "running the checks and benchmarks (gpu_check)"
rm -f "$OUT"
RUST_BACKTRACE=0 RUST_LIB_BACKTRACE=0 RLAUNCH_GPU_CHECK_OUT="$OUT" RLAUNCH_GPU_CHECK_DATE="$DATE" \
  cargo test "${CARGO_FLAGS[@]}" "${PROFILE[@]}" -p integration-tests --test kernels_nvrtc -- --ignored gpu_check --nocapture --test-threads 1 \
  2>&1 | tee "$LOG/gpu_check.txt"
check_rc=${PIPESTATUS[0]}
if [ ! -s "$OUT" ]; then
  { echo "# GPU checks and benchmarks"; echo; echo "- date: $DATE"; echo
    echo "gpu_check did not produce a report (exit $check_rc); its output:"; echo; echo '```'
    sed -n '/^test gpu_check/,$p' "$LOG/gpu_check.txt" | head -60; echo '```'; } > "$OUT"
fi

# train --device cuda against the CPU run, under rlaunch, once the example supports it.
{
  echo; echo "## train example: --device cuda against --device cpu (under rlaunch, 1 rank)"; echo
} >> "$OUT"
train_rc=0
if cargo build "${CARGO_FLAGS[@]}" "${PROFILE[@]}" -p rlaunch --features cuda --example train >/dev/null 2>&1 \
   && cargo build "${CARGO_FLAGS[@]}" "${PROFILE[@]}" -p rlaunch-launcher >/dev/null 2>&1 \
   && $TDIR/examples/train --help 2>&1 | grep -q -- '--device'; then
  for dev in cpu cuda; do
    $TDIR/rlaunch --standalone --nproc-per-node 1 $TDIR/examples/train \
      --device "$dev" --steps 300 --log-every 50 > "$LOG/train-$dev.txt" 2>&1
    rc=$?
    [ $rc -ne 0 ] && train_rc=1
    { echo "### --device $dev (exit $rc)"; echo; echo '```'; grep -E 'train:|step|loss|accuracy|notice|device' "$LOG/train-$dev.txt" | tail -15; echo '```'; echo; } >> "$OUT"
  done
  # Loss at the last logged step, both runs: they must agree within 5% (fp32, 50-step window averages).
  lc=$(grep -oE 'loss [0-9.]+' "$LOG/train-cpu.txt" | tail -1 | awk '{print $2}')
  lg=$(grep -oE 'loss [0-9.]+' "$LOG/train-cuda.txt" | tail -1 | awk '{print $2}')
  if [ -n "$lc" ] && [ -n "$lg" ]; then
    verdict=$(awk -v a="$lc" -v b="$lg" 'BEGIN { d = (a - b) / a; if (d < 0) d = -d; printf "%s (relative gap %.2e, bound 5e-2)", (d <= 0.05 ? "pass" : "FAIL"), d }')
    echo "Last logged loss: cpu $lc, cuda $lg: $verdict" >> "$OUT"
    case "$verdict" in FAIL*) train_rc=1 ;; esac
  else
    echo "Could not read the losses from the train logs (see above)." >> "$OUT"
    train_rc=1
  fi
else
  echo "Skipped: examples/train has no \`--device\` flag yet (or it did not build with --features cuda). The GPU-vs-CPU training comparison above (GpuMlp against rlaunch::model::Mlp) stands in for it." >> "$OUT"
fi

say "report: $OUT"
if [ "$check_rc" -eq 0 ] && [ "$train_rc" -eq 0 ]; then
  say "every check passed"
  exit 0
fi
say "FAILED (gpu_check exit $check_rc, train comparison $train_rc); see $OUT and $LOG"
exit 1
