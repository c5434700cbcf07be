"""What a torch.distributed.checkpoint save and load cost through rlaunch (`rlaunch.dcp`), beside
DCP's own files on a local disk and on tmpfs, and one memcpy of the same state.

Run: .venv/bin/python bench/snapshot/dcp_cost.py [--mib 256] [--reps 5] [--out bench/snapshot/DCP.md]
It starts itself under `rlaunch --standalone --nproc-per-node 1 --max-restarts 1`: the first
attempt saves and measures, then exits 1; the restarted one loads what the agent kept (the step
this round restores) and DCP's files of the same step (from the local disk also with the page
cache dropped before each load, which needs root).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHM = "/dev/shm"
sys.path.insert(0, HERE)
from cost import state_of  # noqa: E402  (the same state as bench/snapshot/cost.py's)


def timed(fn, reps):
    ts = []
    for i in range(reps):
        t = time.perf_counter()
        fn(i)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def child(out, mib, reps, disk):
    import torch
    import torch.distributed.checkpoint as dcp

    import rlaunch.dcp

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    state = state_of(mib)
    shm = os.path.join(SHM, "rlaunch-dcp-bench")
    r = {}
    if attempt == 0:
        dst = {k: torch.zeros_like(v) for k, v in state.items()}

        def memcpy(_):
            for k, v in state.items():
                dst[k].copy_(v)

        memcpy(0)
        r["memcpy"] = timed(memcpy, reps)

        def rl(i):
            w = rlaunch.dcp.Writer(i)
            dcp.save(state, storage_writer=w)
            assert w.saved, "the agent holds the step"

        r["rlaunch_first"] = timed(rl, 1)
        r["rlaunch"] = timed(lambda i: rl(i + 1), reps)
        for name, base in (("disk", disk), ("tmpfs", shm)):
            def to_files(i, base=base):
                path = os.path.join(base, f"step-{i}")
                shutil.rmtree(path, ignore_errors=True)
                dcp.save(state, checkpoint_id=path)

            r[name] = timed(to_files, reps)
        pending = []

        def async_disk(i):
            path = os.path.join(disk, f"async-{i}")
            shutil.rmtree(path, ignore_errors=True)
            pending.append(dcp.async_save(state, checkpoint_id=path))

        r["async_disk_blocking"] = timed(async_disk, reps)
        for f in pending:
            f.result()
        with open(os.path.join(out, "save.json"), "w") as f:
            json.dump(r, f)
        sys.stdout.flush()
        os._exit(1)
    target = {k: torch.zeros_like(v) for k, v in state.items()}
    step = rlaunch.dcp.restored_step()
    assert step == reps, f"the last step saved ({reps}) is restored, not {step}"
    r["rlaunch_load"] = timed(lambda _: dcp.load(target, storage_reader=rlaunch.dcp.Reader()), reps)
    assert all(torch.equal(target[k], state[k]) for k in state), "loaded as saved"
    for name, base in (("disk", disk), ("tmpfs", shm)):
        path = os.path.join(base, f"step-{reps - 1}")
        r[f"{name}_load"] = timed(lambda _, path=path: dcp.load(target, checkpoint_id=path), reps)

    def cold(_):
        # As on a host that did not write the files (a replacement): the page cache dropped
        # first (root), outside the time measured.
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        t = time.perf_counter()
        dcp.load(target, checkpoint_id=os.path.join(disk, f"step-{reps - 1}"))
        return time.perf_counter() - t

    r["disk_cold_load"] = statistics.median(cold(i) for i in range(reps))
    with open(os.path.join(out, "load.json"), "w") as f:
        json.dump(r, f)
    shutil.rmtree(shm, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "DCP.md"))
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target", "release", "rlaunch"))
    ap.add_argument("--child", nargs=2, metavar=("DIR", "DISK"))
    a = ap.parse_args()
    if a.child:
        return child(a.child[0], a.mib, a.reps, a.child[1])
    work = tempfile.mkdtemp(prefix="rlaunch-dcp-bench-")
    # DCP's files on the disk this repository is on (not tmpfs), written with its default fsync.
    disk = tempfile.mkdtemp(prefix="dcp-files-", dir=os.path.join(ROOT, "target"))
    try:
        cmd = [a.rlaunch, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", sys.executable,
               os.path.abspath(__file__), "--mib", str(a.mib), "--reps", str(a.reps), "--child", work, disk]
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        if p.returncode != 0:
            sys.exit(f"the benchmark failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
        r = {**json.load(open(os.path.join(work, "save.json"))), **json.load(open(os.path.join(work, "load.json")))}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    ms = lambda k: f"{r[k] * 1e3:.0f} ms"  # noqa: E731
    x = lambda a_, b: f"{r[a_] / r[b]:.2f}x"  # noqa: E731
    import torch
    rows = [
        ("one memcpy of the state (`copy_` into allocated tensors)", "memcpy", "1.00x"),
        ("`dcp.save` through `rlaunch.dcp.Writer` (steady: the agent reuses a replaced step's buffer)", "rlaunch", x("rlaunch", "memcpy") + " memcpy"),
        ("`dcp.save` through `rlaunch.dcp.Writer`, the first (fresh memory)", "rlaunch_first", x("rlaunch_first", "memcpy") + " memcpy"),
        ("`dcp.save` to DCP's files on the local disk (fsync)", "disk", x("disk", "rlaunch") + " rlaunch"),
        ("`dcp.save` to DCP's files on tmpfs", "tmpfs", x("tmpfs", "rlaunch") + " rlaunch"),
        ("`dcp.async_save` to the local disk, until it returns (training blocked)", "async_disk_blocking", x("async_disk_blocking", "rlaunch") + " rlaunch"),
        ("`dcp.load` through `rlaunch.dcp.Reader` after a restart (into the program's tensors)", "rlaunch_load", ""),
        ("`dcp.load` of DCP's files on the local disk (in the page cache)", "disk_load", x("disk_load", "rlaunch_load") + " rlaunch"),
        ("`dcp.load` of DCP's files on tmpfs", "tmpfs_load", x("tmpfs_load", "rlaunch_load") + " rlaunch"),
        ("`dcp.load` of DCP's files on the local disk, the page cache dropped", "disk_cold_load", x("disk_cold_load", "rlaunch_load") + " rlaunch"),
    ]
    lines = [
        "# torch.distributed.checkpoint through rlaunch (`rlaunch.dcp`) vs DCP's own files",
        "",
        f"Date: {time.strftime('%Y-%m-%d')}. Machine: {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, PyTorch {torch.__version__} (CPU). "
        f"Script: `bench/snapshot/dcp_cost.py`, one rank under `rlaunch --standalone`, {a.mib} MiB of float32 "
        f"state in 16 tensors, median of {a.reps} (the first save: one). Goals (issue 36): the save blocks "
        "training for at most 1.5x one memcpy; the load at least 5x faster than DCP's own.",
        "",
        "| what | time | against |",
        "|---|---|---|",
    ]
    lines += [f"| {what} | {ms(k)} | {against} |" for what, k, against in rows]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
