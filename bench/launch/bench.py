"""Launch overhead: start -> all workers running -> clean exit, rlaunch against torchrun.

Both launchers start N trivial workers (/bin/true, `--no-python` for torchrun) on one node
with their standalone rendezvous. Wall time is measured around the whole command; peak memory
is ru_maxrss from wait4(), the largest resident set among the launcher and the workers it
waited for. Usage: .venv/bin/python bench/launch/bench.py [--reps 5] [--out bench/launch/RESULTS.md]
"""

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_once(cmd):
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, rusage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t0
    p.returncode = os.waitstatus_to_exitcode(status)
    if p.returncode != 0:
        raise SystemExit(f"{cmd} exited {p.returncode}")
    return wall, rusage.ru_maxrss / 1024.0  # KiB -> MiB


def measure(cmd, reps):
    runs = [run_once(cmd) for _ in range(reps)]
    return statistics.median(r[0] for r in runs), max(r[1] for r in runs)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/launch/RESULTS.md"))
    args = ap.parse_args()
    rlaunch = os.path.join(ROOT, "target/release/rlaunch")
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    true = "/bin/true"
    rows = []
    for n in (1, 4, 16):
        r_wall, r_mem = measure([rlaunch, "--standalone", "--nproc-per-node", str(n), true], args.reps)
        t_wall, t_mem = measure([torchrun, "--standalone", "--nproc-per-node", str(n), "--no-python", true], max(2, args.reps // 2))
        rows.append((n, r_wall, t_wall, r_mem, t_mem))
    lines = [
        f"# Launch overhead, rlaunch vs torchrun",
        "",
        f"Measured {datetime.date.today()} on this project's machine (2 cores, 24 GiB), "
        f"`{os.path.relpath(__file__, ROOT)}`: median wall of {args.reps} runs (torchrun: {max(2, args.reps // 2)}), "
        "peak RSS = largest ru_maxrss among the launcher and its workers.",
        "",
        "| workers | rlaunch wall | torchrun wall | speed-up | rlaunch peak RSS | torchrun peak RSS |",
        "|---|---|---|---|---|---|",
    ]
    for n, rw, tw, rm, tm in rows:
        lines.append(f"| {n} | {rw*1000:.1f} ms | {tw*1000:.0f} ms | {tw/rw:.0f}x | {rm:.1f} MiB | {tm:.0f} MiB |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(args.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
