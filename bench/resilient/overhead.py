"""Steady state with and without @rlaunch.resilient: the same DDP program (bench/resilient/train.py,
2 ranks, gloo, the model under torch.compile, a snapshot every step, no pause between steps) in
an elastic one-node job, the function decorated or called as it is; runs alternate.

Measured: steady steps/s of rank 0 over the last STEPS - 50 steps of each run.

Usage: .venv/bin/python bench/resilient/overhead.py [--runs 3] [--steps 400] [--out bench/resilient/OVERHEAD.md]
"""

import argparse
import os
import shutil
import statistics
import subprocess
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def run(args, mode, port):
    out = tempfile.mkdtemp(prefix="rlaunch-bench-overhead-")
    env = dict(os.environ, BENCH_PAUSE="0", BENCH_COMPILE="1", BENCH_HOST="a", RLAUNCH_LOG="warn")
    cmd = [args.rlaunch, "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "rlaunch",
           "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"overhead-{mode}-{port}",
           args.python, os.path.join(HERE, "train.py"), out, mode, str(args.steps)]
    try:
        p = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            raise SystemExit(f"{mode} run failed ({p.returncode}):\n{p.stderr[-3000:]}")
        steps = []
        for line in open(os.path.join(out, "events.log")):
            parts = line.split()
            if parts and parts[0] == "step":
                kv = dict(x.split("=", 1) for x in parts[2:] if "=" in x)
                steps.append((int(parts[1]), float(kv["t"])))
        steps = [s for s in steps if s[0] >= 50]
        return (len(steps) - 1) / (steps[-1][1] - steps[0][1])
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target/debug/rlaunch"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    ap.add_argument("--out", default=os.path.join(HERE, "OVERHEAD.md"))
    args = ap.parse_args()
    rates = {"plain": [], "resilient": []}
    port = 29560
    for i in range(args.runs):
        for mode in ("plain", "resilient"):
            port += 1
            r = run(args, mode, port)
            rates[mode].append(r)
            print(f"run {i + 1} {mode}: {r:.1f} steps/s", flush=True)
    med = {m: statistics.median(v) for m, v in rates.items()}
    ratio = med["resilient"] / med["plain"]
    text = (f"# Steady state with and without `@rlaunch.resilient`\n\n"
            f"Date: {time.strftime('%Y-%m-%d')}. Machine: 2 cores, 24 GiB, PyTorch 2.15 (CPU, gloo), rlaunch's debug "
            f"build. Script: `bench/resilient/overhead.py`. `train.py` with 2 ranks in an elastic one-node job "
            f"(the agent hosting its rendezvous), the model under `torch.compile`, a snapshot every step, no pause "
            f"between steps, {args.steps} steps; steady steps/s of rank 0 from step 50; {args.runs} runs of each, "
            f"alternating.\n\n"
            f"| | steps/s, each run | median |\n|---|---|---|\n"
            f"| called as it is | {', '.join(f'{r:.1f}' for r in rates['plain'])} | {med['plain']:.1f} |\n"
            f"| `@rlaunch.resilient` | {', '.join(f'{r:.1f}' for r in rates['resilient'])} | {med['resilient']:.1f} |\n\n"
            f"Resilient / plain: {ratio:.3f} (goal: within 1 %).\n")
    print(text)
    if args.out:
        open(args.out, "w").write(text)


if __name__ == "__main__":
    main()
