#!/usr/bin/env bash
# The GPU checks in one command, on a machine with an NVIDIA GPU (driver >= 580, CUDA 13):
#   1. the ignored test `kernels_nvrtc::gpu_check` (integration-tests/tests/kernels_nvrtc.rs in
#      the test binary `integration` ->
#      rlaunch::gpu::check::run): every kernel in kernels/cu/*.cu against its CPU reference;
#      GPU training (fp32 and bf16) against the CPU model through a 1-rank NCCL group; an NCCL
#      all-reduce bootstrapped through a real TCPStore; rlaunch's NCCL group against raw
#      ncclAllReduce at the same sizes (overhead %); the fused update kernels against the
#      card's device-to-device copy bandwidth, in the same run;
#   2. `train --device cuda` (fp32 and bf16) against `--device cpu`, under rlaunch;
#   3. an unmodified PyTorch DDP script on NCCL (bench/gpu/ddp_nccl.py) under
#      `rlaunch --standalone` and under torchrun in the same run (2 ranks on the one GPU where
#      NCCL allows it, else 1), then a rank SIGKILLed mid-step under rlaunch: the group is
#      restarted with no hang in NCCL and the job finishes from its checkpoint;
#   4. bench/gpu/gpu_paths.py: snapshots of ~1 GiB of CUDA tensors (save against one
#      device-to-host copy and torch.save, load back onto the device byte-equal), warm workers
#      with a CUDA program (nothing on a device before the rank is known; crash to first CUDA
#      step warm, cold and under torchrun), an NCCL rank killed mid-step resumed from its
#      snapshot, and `train --device cuda` against the same MLP in PyTorch DDP.
# Everything lands in bench/gpu/RESULTS.md (or $RLAUNCH_GPU_CHECK_OUT) with the device, the
# versions and the date; raw logs in $RLAUNCH_GPU_CHECK_LOGS (default: a temporary folder).
#
# Usage:
#   scripts/gpu-check.sh                 build here (cargo, --features cuda) and run everything
#   scripts/gpu-check.sh --pack DIR      build here and put the binaries in DIR/bin (stripped),
#                                        for a GPU machine without a Rust toolchain
#   scripts/gpu-check.sh --prebuilt DIR  run everything with the binaries in DIR/bin
# RLAUNCH_GPU_CHECK_SECTIONS="1 2 3 4 5" (the default) names the sections to run: a machine lent
# for 10 minutes a command runs them in two commands (say "1 2 3 4", then "5").
# Exit status 0 = every check passed.
# Libraries: libcuda from the driver; NVRTC 13, cuBLAS 13 and NCCL 2 from the CUDA toolkit,
# the system, PyPI wheels in .venv or in the system Python (all searched; see
# kernels/src/probe.rs). Extra directories: RLAUNCH_CUDA_LIB_DIRS=dir1:dir2.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=run PREBUILT=
case "${1:-}" in
  --pack) MODE=pack; PREBUILT=${2:?--pack DIR} ;;
  --prebuilt) PREBUILT=${2:?--prebuilt DIR} ;;
  "") ;;
  *) echo "usage: $0 [--pack DIR | --prebuilt DIR]" >&2; exit 2 ;;
esac
OUT=${RLAUNCH_GPU_CHECK_OUT:-bench/gpu/RESULTS.md}
LOG=${RLAUNCH_GPU_CHECK_LOGS:-$(mktemp -d)/gpu-check}
mkdir -p "$LOG" "$(dirname "$OUT")"
DATE=$(date -u +%Y-%m-%dT%H:%M:%SZ)

say() { printf 'gpu-check: %s\n' "$*" >&2; }

# Release by default (the benchmarks need it); RLAUNCH_GPU_CHECK_DEBUG=1 for a quick dry run.
if [ "${RLAUNCH_GPU_CHECK_DEBUG:-0}" = 1 ]; then PROFILE=(); else PROFILE=(--release); fi

# Builds rlaunch, the train example (--features cuda) and the check's test binary; sets
# RLAUNCH, TRAIN and CHECK to their paths.
build() {
  local flags=() msg
  say "building (${PROFILE[*]:-debug}, --features cuda)"
  if ! cargo build "${PROFILE[@]}" -p rlaunch --features cuda --example train; then
    say "cargo build failed; retrying with --offline"   # air-gapped GPU machines with ~/.cargo's cache
    flags=(--offline)
    cargo build "${flags[@]}" "${PROFILE[@]}" -p rlaunch --features cuda --example train || { say "build failed"; exit 1; }
  fi
  cargo build "${flags[@]}" "${PROFILE[@]}" -p rlaunch-launcher --bin rlaunch || { say "build of rlaunch failed"; exit 1; }
  msg=$(cargo test "${flags[@]}" "${PROFILE[@]}" -p integration-tests --test integration --no-run --message-format=json) \
    || { say "build of the check failed"; exit 1; }
  CHECK=$(printf '%s\n' "$msg" | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "integration" and m.get("executable"):
        print(m["executable"])')
  local tdir=target/debug; [ ${#PROFILE[@]} -gt 0 ] && tdir=target/release
  RLAUNCH=$tdir/rlaunch TRAIN=$tdir/examples/train
  for f in "$RLAUNCH" "$TRAIN" "$CHECK"; do [ -x "$f" ] || { say "built binary missing: $f"; exit 1; }; done
}

if [ -n "$PREBUILT" ] && [ "$MODE" = run ]; then
  RLAUNCH=$PREBUILT/bin/rlaunch TRAIN=$PREBUILT/bin/train CHECK=$PREBUILT/bin/integration
  for f in "$RLAUNCH" "$TRAIN" "$CHECK"; do [ -x "$f" ] || { say "prebuilt binary missing: $f"; exit 1; }; done
else
  build
fi
if [ "$MODE" = pack ]; then
  mkdir -p "$PREBUILT/bin"
  cp "$RLAUNCH" "$PREBUILT/bin/rlaunch"; cp "$TRAIN" "$PREBUILT/bin/train"; cp "$CHECK" "$PREBUILT/bin/integration"
  strip "$PREBUILT"/bin/* 2>/dev/null || true
  du -sh "$PREBUILT"/bin/* >&2
  say "packed into $PREBUILT/bin; on the GPU machine: scripts/gpu-check.sh --prebuilt $PREBUILT"
  exit 0
fi
# Absolute paths: rlaunch runs workers from this directory, the logs land elsewhere.
RLAUNCH=$(realpath "$RLAUNCH") TRAIN=$(realpath "$TRAIN") CHECK=$(realpath "$CHECK")

PY=${RLAUNCH_PYTHON:-python3}
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
for py in "$PY" .venv/bin/python; do
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

SECTIONS=" ${RLAUNCH_GPU_CHECK_SECTIONS:-1 2 3 4 5} "
want() { [[ "$SECTIONS" == *" $1 "* ]]; }
check_rc=0 train_rc=0 torch_rc=0 paths_rc=0 survivor_rc=0
rm -f "$OUT"

# ---- 1. kernels, GPU training, NCCL, benchmarks ---------------------------------------------
if want 1; then
say "running the checks and benchmarks (gpu_check)"
RUST_BACKTRACE=0 RUST_LIB_BACKTRACE=0 RLAUNCH_GPU_CHECK_OUT="$OUT" RLAUNCH_GPU_CHECK_DATE="$DATE" \
  timeout 240 "$CHECK" --ignored --exact kernels_nvrtc::gpu_check --nocapture --test-threads 1 2>&1 | tee "$LOG/gpu_check.txt"
check_rc=${PIPESTATUS[0]}
fi
if [ ! -s "$OUT" ]; then
  { echo "# GPU checks and benchmarks"; echo; echo "- date: $DATE"; echo
    if want 1; then
      echo "gpu_check did not produce a report (exit $check_rc); its output:"; echo; echo '```'
      sed -n '/^test kernels_nvrtc::gpu_check/,$p' "$LOG/gpu_check.txt" | head -60; echo '```'
    else
      echo "Sections run: $SECTIONS"
    fi; } > "$OUT"
fi
{ echo; echo "## Versions"; echo; echo '```'
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  nvidia-smi 2>/dev/null | grep -o 'CUDA Version: [0-9.]*'
  command -v nvcc >/dev/null && nvcc --version | tail -2
  "$PY" -c 'import torch, sys; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "nccl", ".".join(map(str, torch.cuda.nccl.version())))' 2>&1
  echo '```'; } >> "$OUT"

# ---- 2. train --device cuda against --device cpu, under rlaunch -----------------------------
if want 2; then
{ echo; echo "## train example: --device cuda against --device cpu (under rlaunch, 1 rank)"; echo; } >> "$OUT"
for run in "cpu fp32" "cuda fp32" "cuda bf16"; do
  set -- $run
  # The loader's path carries the wheel directories: train searches the toolkit and a .venv.
  LD_LIBRARY_PATH="$RLAUNCH_CUDA_LIB_DIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
  timeout 120 "$RLAUNCH" --standalone --nproc-per-node 1 "$TRAIN" \
    --device "$1" --precision "$2" --steps 300 --log-every 50 --no-checkpoint > "$LOG/train-$1-$2.txt" 2>&1
  rc=$?
  [ $rc -ne 0 ] && train_rc=1
  { echo "### --device $1 --precision $2 (exit $rc)"; echo; echo '```'
    grep -E 'train:|step|loss|accuracy|notice|device|error' "$LOG/train-$1-$2.txt" | tail -15; echo '```'; echo; } >> "$OUT"
done
# Loss at the last logged step: fp32 within 5 % of the CPU run, bf16 within 15 %.
lc=$(grep -oE 'loss [0-9.]+' "$LOG/train-cpu-fp32.txt" | tail -1 | awk '{print $2}')
for p in "fp32 0.05" "bf16 0.15"; do
  set -- $p
  lg=$(grep -oE 'loss [0-9.]+' "$LOG/train-cuda-$1.txt" | tail -1 | awk '{print $2}')
  if [ -n "$lc" ] && [ -n "$lg" ]; then
    verdict=$(awk -v a="$lc" -v b="$lg" -v m="$2" 'BEGIN { d = (a - b) / a; if (d < 0) d = -d; printf "%s (relative gap %.2e, bound %s)", (d <= m ? "pass" : "FAIL"), d, m }')
    echo "Last logged loss, $1: cpu $lc, cuda $lg: $verdict" >> "$OUT"
    case "$verdict" in FAIL*) train_rc=1 ;; esac
  else
    echo "Could not read the losses of the $1 run from the train logs (see above)." >> "$OUT"
    train_rc=1
  fi
  echo >> "$OUT"
done

fi

# ---- 3. PyTorch DDP on NCCL: rlaunch against torchrun, then a rank killed mid-step -----------
# (The probe of how many ranks share the GPU serves section 4 too.)
if want 3 || want 4; then
{ echo; echo "## PyTorch DDP on NCCL (bench/gpu/ddp_nccl.py, unmodified torchrun-style script)"; echo; } >> "$OUT"
SCRIPT=bench/gpu/ddp_nccl.py
# Two ranks on one GPU need NCCL to allow it (NCCL_MULTI_RANK_GPU_ENABLE, NCCL 2.30+); try it
# under torchrun, else one rank per GPU.
SHARE=()
ngpu=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
NPROC=$ngpu
if [ "${ngpu:-0}" -lt 2 ]; then
  NPROC=1
  if NCCL_MULTI_RANK_GPU_ENABLE=1 timeout 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
       "$SCRIPT" --steps 30 --warmup 5 > "$LOG/ddp-probe.txt" 2>&1; then
    NPROC=2; export NCCL_MULTI_RANK_GPU_ENABLE=1
    echo "Two ranks share the one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1 accepted)." >> "$OUT"
  else
    echo "Two ranks on one GPU refused by this NCCL (probe under torchrun, last lines below)." >> "$OUT"
    { echo; echo '```'; grep -vE '^\s*$' "$LOG/ddp-probe.txt" | grep -E 'Error|NCCL|Duplicate|same GPU|invalid' | grep -v error_file | tail -8; echo '```'; echo; } >> "$OUT"
    # Each rank a host of its own to NCCL (bench/gpu/hostid.py sets NCCL_HOSTID per rank): the
    # two ranks talk over NCCL's socket transport, as two nodes would, and the script runs as it is.
    if timeout 90 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 \
         bench/gpu/hostid.py "$SCRIPT" --steps 30 --warmup 5 > "$LOG/ddp-probe-hostid.txt" 2>&1; then
      NPROC=2 SHARE=(bench/gpu/hostid.py)
      echo "Two ranks share the one GPU with an NCCL_HOSTID each (bench/gpu/hostid.py: NCCL's socket transport on loopback, as between two nodes)." >> "$OUT"
    else
      echo "Two ranks with an NCCL_HOSTID each failed too (below): one rank." >> "$OUT"
      { echo; echo '```'; grep -vE '^\s*$' "$LOG/ddp-probe-hostid.txt" | grep -E 'Error|NCCL|invalid' | grep -v error_file | tail -8; echo '```'; echo; } >> "$OUT"
    fi
  fi
fi
fi
if want 3; then
{ echo; echo "| launcher | ranks | wall s (launch to exit) | steps/s rank 0 | exit |"; echo "|---|---|---|---|---|"; } >> "$OUT"
declare -A WALL RATE
for round in 1 2; do
  for who in torchrun rlaunch; do
    if [ $who = torchrun ]; then cmd=("$PY" -m torch.distributed.run); else cmd=("$RLAUNCH"); fi
    t0=$(date +%s.%N)
    timeout 120 "${cmd[@]}" --standalone --nproc-per-node "$NPROC" "${SHARE[@]}" "$SCRIPT" --steps 300 > "$LOG/ddp-$who-$round.txt" 2>&1
    rc=$?
    t1=$(date +%s.%N)
    wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
    rate=$(grep -oE 'rank=0 .*steps_per_s=[0-9.]+' "$LOG/ddp-$who-$round.txt" | grep -oE '[0-9.]+$' | tail -1)
    oks=$(grep -c 'ddp-nccl ok' "$LOG/ddp-$who-$round.txt")
    [ $rc -ne 0 ] || [ "$oks" -ne "$NPROC" ] && torch_rc=1
    echo "| $who (run $round) | $NPROC | $wall | ${rate:-?} | $rc ($oks of $NPROC ranks ok) |" >> "$OUT"
    WALL[$who]="${WALL[$who]:-} $wall"; RATE[$who]="${RATE[$who]:-} ${rate:-0}"
  done
done
ratio() { awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, x, " "); split(b, y, " "); sa = 0; sb = 0; for (i = 1; i <= n; i++) { sa += x[i]; sb += y[i] } if (sb > 0) printf "%.3f", sa / sb; else print "?" }'; }
{ echo; echo "rlaunch / torchrun: wall $(ratio "${WALL[rlaunch]}" "${WALL[torchrun]}"), steps/s $(ratio "${RATE[rlaunch]}" "${RATE[torchrun]}") (sums over both runs)."; echo
  echo "Rank lines (rlaunch, run 2):"; echo; echo '```'; grep -E 'ddp-nccl' "$LOG/ddp-rlaunch-2.txt" | tail -4; echo '```'; } >> "$OUT"

# A rank SIGKILLs itself mid-step (forward done, its peers in the backward all-reduce).
kill_rank=$((NPROC - 1))
ck=$(mktemp -d)
t0=$(date +%s.%N)
timeout 150 "$RLAUNCH" --standalone --nproc-per-node "$NPROC" --max-restarts 1 "${SHARE[@]}" "$SCRIPT" --steps 300 \
  --ckpt "$ck" --ckpt-every 20 --kill-rank "$kill_rank" --kill-step 150 > "$LOG/ddp-kill.txt" 2>&1
rc=$?
t1=$(date +%s.%N)
wall=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.2f", b - a }')
restarted=$(grep -c 'ddp-nccl: world .* restart 1 resume step' "$LOG/ddp-kill.txt")
finished=$(grep -c 'ddp-nccl ok .*restart=1' "$LOG/ddp-kill.txt")
verdict=pass
if [ $rc -ne 0 ] || [ "$restarted" -lt 1 ] || [ "$finished" -ne "$NPROC" ]; then verdict=FAIL; torch_rc=1; fi
{ echo; echo "### Rank $kill_rank SIGKILLed in step 150 under rlaunch --max-restarts 1: $verdict"; echo
  echo "exit $rc after $wall s (timeout 150 s: a hang in NCCL would show as 124); restarted group resumed: $restarted; ranks finished in attempt 1: $finished of $NPROC."; echo
  echo '```'; grep -E 'ddp-nccl|restart|exit|signal|fail|Error|error' "$LOG/ddp-kill.txt" | grep -v '^\s*$' | head -30; echo '```'; } >> "$OUT"

fi

# ---- 4. what landed after the first GPU checks (bench/gpu/gpu_paths.py) ----------------------
if want 4; then
# Snapshots of CUDA tensors, warm workers with CUDA, a rank of an NCCL job killed mid-step with
# snapshots, the Rust runtime against PyTorch on the same MLP; each beside its peer.
say "running the snapshot, warm-worker and Rust-against-PyTorch checks (gpu_paths.py)"
RLAUNCH_CUDA_LIB_DIRS="$RLAUNCH_CUDA_LIB_DIRS" timeout 420 "$PY" bench/gpu/gpu_paths.py --rlaunch "$RLAUNCH" \
  --train "$TRAIN" --out "$OUT" --logs "$LOG" --nproc "$NPROC" ${SHARE:+--share-hostid} ${RLAUNCH_GPU_PATHS_ONLY:+--only "$RLAUNCH_GPU_PATHS_ONLY"} || paths_rc=1

fi

# ---- 5. a survivor keeps its process on NCCL (bench/gpu/nccl_survivor.py) ------------------
if want 5; then
# Two ranks on the GPU (an NCCL_HOSTID each), the peer killed or stopped mid-step: the survivor
# aborts the communicator while its all-reduce waits, makes a new group and trains on.
say "running the survivor checks (nccl_survivor.py)"
timeout 240 "$PY" bench/gpu/nccl_survivor.py --out "$OUT" --logs "$LOG" > "$LOG/nccl_survivor.txt" 2>&1 || survivor_rc=1
tail -5 "$LOG/nccl_survivor.txt" >&2
fi

say "report: $OUT; logs: $LOG"
if [ "$check_rc" -eq 0 ] && [ "$train_rc" -eq 0 ] && [ "$torch_rc" -eq 0 ] && [ "$paths_rc" -eq 0 ] && [ "$survivor_rc" -eq 0 ]; then
  say "every check passed"
  exit 0
fi
say "FAILED (gpu_check exit $check_rc, train comparison $train_rc, PyTorch NCCL $torch_rc, new paths $paths_rc, survivor $survivor_rc); see $OUT and $LOG"
exit 1
