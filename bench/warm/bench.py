"""A worker crashes -> the job training again: rlaunch with warm workers, rlaunch with
`--warm-workers off`, and torchrun, in one run, on the same PyTorch DDP program (train.py: gloo,
2 ranks, a snapshot every step; rank 1 exits at step 240 of the first attempt, about 8 s in).

Measured per run, from the crash (the time rank 1 wrote just before it exits):
  - first step: the first step any rank completes in the second attempt;
  - steps computed again: the steps of the first attempt done again in the second.
And, for rlaunch with warm workers, what the waiting interpreters cost: each one's memory
(Pss, private dirty) read from /proc while the job runs, after its imports.

Usage: .venv/bin/python bench/warm/bench.py [--reps 5] [--rlaunch target/debug/rlaunch]
       [--out bench/warm/RESULTS.md] [--plot bench/warm/crash.png]
"""

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRAIN = os.path.join(HERE, "train.py")


def read_steps(d, rank):
    rows = []
    path = os.path.join(d, f"steps.{rank}")
    for line in open(path):
        a, s, t = line.split()
        rows.append((int(a), int(s), float(t)))
    return rows


def warm_memory(agent_pid):
    """Pss and private dirty (KiB) of each warm interpreter this agent started."""
    needle = f"rlaunch-warm-{agent_pid}-".encode()
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            if needle not in open(f"/proc/{pid}/cmdline", "rb").read():
                continue
            roll = open(f"/proc/{pid}/smaps_rollup").read()
        except OSError:
            continue
        fields = {l.split(":")[0]: int(l.split()[1]) for l in roll.splitlines()[1:] if l.endswith("kB")}
        found.append((fields.get("Pss", 0), fields.get("Private_Dirty", 0), fields.get("Rss", 0)))
    return found


def kill_workers_of(d):
    """Kills what is left of a run: workers in process groups of their own (torchrun's), found
    by the BENCH_DIR in their environment."""
    mark = f"BENCH_DIR={d}".encode()
    for pid in os.listdir("/proc"):
        try:
            if pid.isdigit() and mark in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                os.kill(int(pid), 9)
        except OSError:
            pass


def run_once(kind, rlaunch, python):
    with tempfile.TemporaryDirectory(prefix="rlaunch-warm-bench-") as d:
        # The crash comes ~8 s in: after the next warm set (started 2 s in) has imported torch.
        env = dict(os.environ, BENCH_DIR=d, PYTHONPATH=os.path.join(ROOT, "python"), STEPS="360", CRASH_STEP="240")
        common = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "1"]
        if kind == "torchrun":
            cmd = [os.path.join(os.path.dirname(python), "torchrun"), *common, TRAIN]
        else:
            env["RLAUNCH_PYTHON"] = python
            cmd = [rlaunch, *common, "--warm-workers", "on" if kind == "rlaunch warm" else "off", TRAIN]
        p = subprocess.Popen(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        memory = []
        if kind == "rlaunch warm":
            # The next set starts 2 s after the first round's workers; read it once imported.
            deadline = time.time() + 60
            while time.time() < deadline and p.poll() is None:
                time.sleep(0.5)
                m = warm_memory(p.pid)
                if len(m) == 2 and os.path.exists(os.path.join(d, "steps.0")) and time.time() > deadline - 50:
                    memory = m
                    break
        try:
            _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, 9)
            kill_workers_of(d)
            _, err = p.communicate()
            err += "\nstill not done after 60 s: killed (error)"
        crash = float(open(os.path.join(d, "crash")).read())
        rows = read_steps(d, 0) + read_steps(d, 1)
        first_attempt = max(s for a, s, _ in rows if a == 0)
        second = [(s, t) for a, s, t in rows if a == 1]
        curve = sorted((t - crash, s) for a, s, t in read_steps(d, 0))
        if p.returncode != 0 or not second:
            # Never back: say why, from the launcher's own words.
            why = next((l.strip() for l in reversed(err.splitlines()) if "Error" in l or "error" in l), err[-200:])
            print(f"{kind}: exit {p.returncode}, no step after the crash: {why[:300]}", flush=True)
            return None, None, curve, memory
        first_again = min(t for _, t in second) - crash
        redone = len({s for s, _ in second if s <= first_attempt})
        return first_again, redone, curve, memory


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target/debug/rlaunch"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python3"))
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    ap.add_argument("--plot", default=os.path.join(HERE, "crash.png"))
    a = ap.parse_args()
    kinds = ["rlaunch warm", "rlaunch cold", "torchrun"]
    results = {k: [] for k in kinds}
    curves, memory = {}, []
    for rep in range(a.reps):
        for k in kinds:
            first, redone, curve, mem = run_once(k, a.rlaunch, a.python)
            results[k].append((first, redone))
            curves.setdefault(k, curve)
            memory.extend(mem)
            if first is not None:
                print(f"rep {rep} {k}: first step again {first:.2f} s after the crash, {redone} steps again", flush=True)
    lines = [
        "# A worker crashes -> training again: warm workers, cold workers, torchrun",
        "",
        f"Date: {datetime.date.today()}. Machine: this project's 2 cores, 24 GiB. Script: `bench/warm/bench.py`",
        f"({a.reps} runs each, interleaved; median, min-max in brackets). The program: `bench/warm/train.py`,",
        "PyTorch DDP with gloo on 2 ranks of one node, a snapshot in the agents' memory every step",
        "(`rlaunch.snapshot`, which does nothing under torchrun), rank 1 exits at step 240 of the first",
        "attempt (about 8 s in); `--max-restarts 1`. Timed from the crash to the first step completed again.",
        "",
        "| launcher | crash -> first step again | steps computed again | vs torchrun |",
        "|---|---|---|---|",
    ]
    back = {k: [(f, r) for f, r in results[k] if f is not None] for k in kinds}
    t_med = statistics.median(f for f, _ in back["torchrun"]) if back["torchrun"] else None
    for k in kinds:
        never = len(results[k]) - len(back[k])
        if not back[k]:
            lines.append(f"| {k} | never ({never} of {len(results[k])} runs: the new attempt failed) | - | - |")
            continue
        firsts = [f for f, _ in back[k]]
        redone = [r for _, r in back[k]]
        med = statistics.median(firsts)
        ratio = "1x" if k == "torchrun" else (f"{t_med / med:.1f}x faster" if t_med else "torchrun never back")
        note = f"; {never} runs never back" if never else ""
        lines.append(
            f"| {k} | {med:.2f} s ({min(firsts):.2f}-{max(firsts):.2f}){note} | {statistics.median(redone):g} "
            f"({min(redone)}-{max(redone)}) | {ratio} |"
        )
    if memory:
        pss = [m[0] / 1024 for m in memory]
        dirty = [m[1] / 1024 for m in memory]
        rss = [m[2] / 1024 for m in memory]
        lines += [
            "",
            "What a waiting warm interpreter costs (it has imported torch, torch.nn, torch.distributed),",
            f"read from /proc/PID/smaps_rollup while the job runs ({len(memory)} readings):",
            "",
            "| per local rank | median | min-max |",
            "|---|---|---|",
            f"| Pss (its share of every page it maps) | {statistics.median(pss):.0f} MiB | {min(pss):.0f}-{max(pss):.0f} |",
            f"| private dirty (memory no other process shares) | {statistics.median(dirty):.0f} MiB | {min(dirty):.0f}-{max(dirty):.0f} |",
            f"| Rss (including shared libraries' pages) | {statistics.median(rss):.0f} MiB | {min(rss):.0f}-{max(rss):.0f} |",
        ]
    lines += ["", f"![step against time around the crash]({os.path.basename(a.plot)})", ""]
    with open(a.out, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for k in kinds:
            xs, ys = zip(*curves[k])
            ax.plot(xs, ys, ".", markersize=3, label=k)
        ax.axvline(0, color="grey", linewidth=0.8)
        ax.set_xlabel("seconds from the crash (rank 1 exits at step 240)")
        ax.set_ylabel("step completed (rank 0)")
        ax.set_xlim(-3, 12)
        ax.legend()
        ax.set_title("A worker crash: PyTorch DDP, 2 ranks, one node")
        fig.tight_layout()
        fig.savefig(a.plot, dpi=110)
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)


if __name__ == "__main__":
    main()
