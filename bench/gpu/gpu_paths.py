"""The paths that landed after the last GPU check, on a GPU, each against its peer in the same
run (bench/gpu/paths_worker.py does the work in the workers):

  1. snapshots of CUDA tensors: `rlaunch.snapshot.save` of a model and an Adam optimizer of
     about 1 GiB on the device, against one device-to-host copy of the same bytes and
     `torch.save` to /dev/shm; `load` back onto the device, every byte compared;
  2. warm workers with a CUDA program: nothing initialised on a device before the program runs,
     the rank on the device its LOCAL_RANK names; a worker's crash to its first CUDA step again,
     warm against cold (--warm-workers off) against torchrun;
  3. a rank of an NCCL job SIGKILLed mid-step with snapshots every step: resumed at the step it
     died in, its state byte-equal to the step before, no hang in NCCL;
  4. the Rust runtime's `train --device cuda` against the same MLP, batch and precision in
     PyTorch DDP on NCCL (steady steps/s).

Usage: python3 bench/gpu/gpu_paths.py --rlaunch BIN --train BIN --out REPORT.md --logs DIR
Appends its sections to REPORT.md; exit 0 when every check passed.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "paths_worker.py")
HOSTID = os.path.join(HERE, "hostid.py")
PY = sys.executable
failures = []


def run(cmd, log, timeout, env=None):
    t0 = time.time()
    with open(log, "w") as f:
        try:
            p = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=env)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    return rc, t0, time.time()


def load(d, name):
    path = os.path.join(d, name)
    return json.load(open(path)) if os.path.exists(path) else None


def tail(log, n=12):
    try:
        lines = [l.rstrip() for l in open(log, errors="replace") if l.strip()]
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def check(ok, what):
    if not ok:
        failures.append(what)
    return "pass" if ok else "FAIL"


def section_snapshots(a, w):
    w("\n## Snapshots of CUDA tensors (`rlaunch.snapshot.save`/`load`, one rank)\n")
    d = tempfile.mkdtemp(prefix="gpu-snap-")
    log = os.path.join(a.logs, "snap.txt")
    rc, t0, t1 = run([a.rlaunch, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                      "--snapshot-memory", "8192", WORKER, "snap", d], log, 240)
    r0, r1 = load(d, "snap.0.0.json"), load(d, "snap.1.0.json")
    if not r0 or not r1:
        w(f"The run did not finish (exit {rc}); its log:\n\n```\n{tail(log, 30)}\n```\n")
        failures.append("snapshots: no result")
        return
    gib = r0["bytes"] / (1 << 30)
    ms = lambda s: f"{s * 1e3:.1f}"
    w(f"A model of 5 × Linear(4096, 4096) and its Adam state after one step: {gib:.2f} GiB, "
      f"{r0['bytes_on_device'] / (1 << 30):.2f} GiB of it on {r0['device']}. Medians; the save's first "
      f"call separately.\n\n")
    w("| what blocks training | ms | × one device-to-host copy (pageable) | GB/s |\n|---|---|---|---|\n")
    base = r0["d2h_pageable_s"]
    for name, s in [("one device-to-host copy into pageable host memory", r0["d2h_pageable_s"]),
                    ("one device-to-host copy into pinned host memory", r0["d2h_pinned_s"]),
                    ("`rlaunch.snapshot.save` (steps 1-4)", r0["save_s"]),
                    ("`rlaunch.snapshot.save`, first call", r0["save_first_s"]),
                    ("`torch.save` to /dev/shm", r0["torch_save_s"])]:
        w(f"| {name} | {ms(s)} | {s / base:.2f} | {r0['bytes'] / s / 1e9:.1f} |\n")
    w(f"\nEvery save: {', '.join(ms(s) for s in r0['save_all_s'])} ms.\n\n")
    w("| restore onto the device | ms |\n|---|---|\n")
    w(f"| `rlaunch.snapshot.load` | {ms(r1['load_s'])} |\n")
    w(f"| `load` + `load_state_dict` of model and optimizer (on the device) | {ms(r1['load_to_device_s'])} |\n")
    w(f"| `torch.load(map_location=cuda)` + `load_state_dict` | {ms(r1['torch_load_to_device_s'])} |\n")
    ok = rc == 0 and r1["restored_step"] == 4 and r1["tensors_compared"] > 0 and not r1["tensors_differing"] \
        and r1["on_device_after_load"]
    w(f"\nRestored step {r1['restored_step']} (the last saved: 4), {r1['tensors_compared']} tensors compared byte "
      f"for byte after `load_state_dict` on the device, {len(r1['tensors_differing'])} differing "
      f"{r1['tensors_differing'][:4]}, all on the device: {r1['on_device_after_load']}; job exit {rc}: "
      f"**{check(ok, 'snapshots: restore')}**\n")


def section_warm(a, w):
    w("\n## Warm workers with a CUDA program (one rank; a crash 8 s in, then the restart)\n")
    rows = []
    for kind in ["rlaunch (warm workers)", "rlaunch --warm-workers off", "torchrun"]:
        d = tempfile.mkdtemp(prefix="gpu-warm-")
        log = os.path.join(a.logs, f"warm-{kind.split()[0]}-{len(rows)}.txt")
        if kind.startswith("torchrun"):
            cmd = [PY, "-m", "torch.distributed.run"]
        else:
            cmd = [a.rlaunch] + (["--warm-workers", "off"] if "off" in kind else [])
        cmd += ["--standalone", "--nproc-per-node", "1", "--max-restarts", "1", WORKER, "warm", d]
        rc, t0, t1 = run(cmd, log, 120)
        r0, r1 = load(d, "warm.0.0.json"), load(d, "warm.1.0.json")
        rows.append((kind, rc, t0, r0, r1, log))
    w("| launcher | exit | launch → first CUDA step, s | crash → first CUDA step again, s | attempt 0 warm | attempt 1 warm | a CUDA context (device files open) before the program (attempt 0, 1) | device = LOCAL_RANK (0, 1) |\n")
    w("|---|---|---|---|---|---|---|---|\n")
    for kind, rc, t0, r0, r1, log in rows:
        if not r0 or not r1:
            w(f"| {kind} | {rc} | - | - | - | - | - | - |\n")
            failures.append(f"warm: {kind} did not finish")
            continue
        pre = (bool(r0["device_files_open_at_start"]) or r0["cuda_initialised_at_start"],
               bool(r1["device_files_open_at_start"]) or r1["cuda_initialised_at_start"])
        dev = (r0["current_device"] == r0["local_rank"], r1["current_device"] == r1["local_rank"])
        w(f"| {kind} | {rc} | {r0['t_first_cuda_step'] - t0:.2f} | {r1['t_first_cuda_step'] - r0['t_exit']:.2f} | "
          f"{r0['warm']} | {r1['warm']} | {pre[0]}, {pre[1]} | {dev[0]}, {dev[1]} |\n")
        check(rc == 0 and not any(pre) and all(dev), f"warm: {kind}")
        if kind.startswith("rlaunch (warm"):
            check(r1["warm"], "warm: the restarted rank did not start warm")
        if "off" in kind:
            check(not r0["warm"] and not r1["warm"], "warm: a worker started warm with --warm-workers off")
    w(f"\nWhere rlaunch's restarted rank started warm, the device it got: {rows[0][4]['device_uuid'] if rows[0][4] else '-'} "
      f"(CUDA_VISIBLE_DEVICES {rows[0][4]['cuda_visible_devices'] if rows[0][4] else '-'}).\n")


def section_kill(a, w):
    w("\n## A rank of an NCCL job SIGKILLed mid-step, with a snapshot every step\n")
    d = tempfile.mkdtemp(prefix="gpu-kill-")
    log = os.path.join(a.logs, "kill.txt")
    share = [HOSTID] if a.share_hostid else []
    rc, t0, t1 = run([a.rlaunch, "--standalone", "--nproc-per-node", str(a.nproc), "--max-restarts", "1"]
                     + share + [WORKER, "kill", d, "--steps", "300", "--kill-step", "150"], log, 150)
    killed = a.nproc - 1
    k0, k1 = load(d, f"kill.0.{killed}.json"), load(d, f"kill.1.{killed}.json")
    if not k0 or not k1:
        w(f"No result (exit {rc}, 124 = a hang); the log:\n\n```\n{tail(log, 30)}\n```\n")
        failures.append("kill: no result")
        return
    want = k0["saved"].get(str(k1.get("restored_step")))
    ok = rc == 0 and k1.get("restored_step") == 149 and k1["start"] == 150 and want == k1.get("restored_digest") \
        and k1["steps_done"] == 150
    w(f"Rank {killed} of {k0['world']} (NCCL {'.'.join(map(str, k0['nccl']))}) killed itself in step "
      f"{k0['killed_in_step']}; the job exited {rc} after {t1 - t0:.1f} s (timeout 150 s); the restarted rank "
      f"restored step {k1.get('restored_step')} in {k1['load_s'] * 1e3:.1f} ms, resumed at step {k1['start']}, its "
      f"parameters equal to the ones saved for step 149: {want == k1.get('restored_digest')}; steps done again "
      f"after the restore: 0 (ran {k1['steps_done']} steps, 150..299): **{check(ok, 'kill: resume')}**\n")
    w(f"\n```\n{tail(log, 10)}\n```\n")


def steady(log):
    m = re.findall(r"steady: ([0-9.]+) steps/s", open(log, errors="replace").read())
    return float(m[-1]) if m else None


def section_mlp(a, w):
    w("\n## The Rust runtime against PyTorch on the same card: the same MLP, batch and precision\n")
    w("One rank, NCCL group of one, 600 steps, steady steps/s after 20 warm-up steps; batches gathered on the "
      "host and copied each step, each step's loss read back (as `train` does). PyTorch: DDP, "
      "`torch.autocast(bfloat16)` for bf16; Rust: `train --device cuda --precision P --snapshot-every 0`.\n\n")
    w("| model (dim-hidden-hidden-8), batch | precision | rlaunch `train` steps/s | PyTorch DDP steps/s | Rust / PyTorch |\n|---|---|---|---|---|\n")
    env = dict(os.environ)
    libs = os.environ.get("RLAUNCH_CUDA_LIB_DIRS", "")
    env["LD_LIBRARY_PATH"] = libs + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    shapes = [(32, 256, 64), (512, 4096, 1024)]
    if os.environ.get("GPU_PATHS_DRY") == "1":
        shapes = [(32, 256, 64)]
    for dim, hidden, batch in shapes:
        for prec in ["fp32", "bf16"]:
            shape = ["--dim", str(dim), "--hidden", str(hidden), "--batch-size", str(batch)]
            rlog = os.path.join(a.logs, f"mlp-rust-{hidden}-{prec}.txt")
            dev = "cpu" if os.environ.get("GPU_PATHS_DRY") == "1" else "cuda"
            rc1, _, _ = run([a.rlaunch, "--standalone", "--nproc-per-node", "1", a.train, "--device", dev,
                             "--precision", prec, "--steps", "600", "--log-every", "100", "--no-checkpoint",
                             "--snapshot-every", "0", *shape], rlog, 120, env)
            d = tempfile.mkdtemp(prefix="gpu-mlp-")
            plog = os.path.join(a.logs, f"mlp-torch-{hidden}-{prec}.txt")
            rc2, _, _ = run([a.rlaunch, "--standalone", "--nproc-per-node", "1", WORKER, "mlp", d, "--steps", "600",
                             "--precision", prec, *shape], plog, 120)
            rs, ps = steady(rlog), steady(plog)
            ratio = f"{rs / ps:.2f}" if rs and ps else "-"
            w(f"| {dim}-{hidden}-{hidden}-8, {batch} | {prec} | {rs or '-'} (exit {rc1}) | "
              f"{f'{ps:.1f}' if ps else '-'} (exit {rc2}) | {ratio} |\n")
            check(rc1 == 0 and rc2 == 0 and rs and ps, f"mlp {hidden} {prec}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rlaunch", required=True)
    ap.add_argument("--train", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--logs", required=True)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--only", default="snap,warm,kill,mlp")
    ap.add_argument("--share-hostid", action="store_true",
                    help="ranks share the GPU with an NCCL_HOSTID each (through hostid.py)")
    a = ap.parse_args()
    os.makedirs(a.logs, exist_ok=True)
    f = open(a.out, "a")

    def w(s):
        f.write(s)
        f.flush()
        sys.stderr.write(s)

    for name, fn in [("snap", section_snapshots), ("warm", section_warm), ("kill", section_kill), ("mlp", section_mlp)]:
        if name in a.only.split(","):
            t = time.time()
            try:
                fn(a, w)
            except Exception as e:  # a broken section still lets the others run
                w(f"\n{name}: the harness failed: {type(e).__name__}: {e}\n")
                failures.append(f"{name}: {e}")
            sys.stderr.write(f"gpu_paths: {name} took {time.time() - t:.1f} s\n")
    w(f"\nNew paths: {'every check passed' if not failures else 'FAILED: ' + '; '.join(failures)}\n")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
