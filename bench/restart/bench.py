"""A worker crashes -> every worker of the group running again: rlaunch against torchrun.

One node, N workers under `--standalone --max-restarts 1`. Each worker is a shell script
(`--no-python` for torchrun) that records the time it started; in the first attempt rank 0
records the time and exits 1 after a short wait, the others sleep. The launcher must notice the
crash, stop the survivors and start the whole group again. Measured: from rank 0's crash to the
last worker of the second attempt started (its first instruction), per run; the median over
`--reps` runs, with min and max. Nothing else runs in the workers, so this is the launcher's
own restart path (plus one `date` per worker, the same for both).

Usage: .venv/bin/python bench/restart/bench.py [--reps 7] [--rlaunch target/release/rlaunch]
       [--containment cgroup|process-group] [--out bench/restart/RESULTS.md]
"""

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# $1: the folder for the timestamps. TORCHELASTIC_RESTART_COUNT is set by both launchers.
WORKER = r"""#!/bin/sh
d="$1"
echo "$(date +%s%N)" > "$d/start.$TORCHELASTIC_RESTART_COUNT.$RANK"
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then
  if [ "$RANK" = 0 ]; then
    sleep 0.3
    echo "$(date +%s%N)" > "$d/crash"
    exit 1
  fi
  exec sleep 30
fi
exit 0
"""


def run_once(cmd, d, n, timeout):
    p = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, timeout=timeout, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{cmd} exited {p.returncode}: {p.stderr[-2000:]}")
    crash = int(open(os.path.join(d, "crash")).read())
    starts = [int(open(os.path.join(d, f"start.1.{r}")).read()) for r in range(n)]
    return (max(starts) - crash) / 1e6  # ms


def measure(make_cmd, n, reps):
    out = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory(prefix="rlaunch-restart-bench-") as d:
            script = os.path.join(d, "worker.sh")
            with open(script, "w") as f:
                f.write(WORKER)
            os.chmod(script, 0o755)
            out.append(run_once(make_cmd(n, script, d), d, n, timeout=60))
    return statistics.median(out), min(out), max(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target/release/rlaunch"))
    ap.add_argument("--torchrun", default=os.path.join(os.path.dirname(sys.executable), "torchrun"))
    ap.add_argument("--containment", default="auto", choices=["auto", "process-group"], help="auto: a cgroup per job where it can")
    ap.add_argument("--workers", default="1,2,4,8")
    ap.add_argument("--baseline", help="an older rlaunch binary, measured in the same run (a column of its own)")
    ap.add_argument("--baseline-label", default="baseline")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench/restart/RESULTS.md"), help="'' for none")
    args = ap.parse_args()

    def rl(n, script, d):
        return [args.rlaunch, "--standalone", "--nproc-per-node", str(n), "--max-restarts", "1",
                "--containment", args.containment, script, d]

    def base(n, script, d):
        return [args.baseline, *rl(n, script, d)[1:]]

    def tr(n, script, d):
        return [args.torchrun, "--standalone", "--nproc-per-node", str(n), "--max-restarts", "1",
                "--no-python", script, d]

    rows = []
    for n in [int(x) for x in args.workers.split(",")]:
        r = measure(rl, n, args.reps)
        b = measure(base, n, args.reps) if args.baseline else None
        t = measure(tr, n, max(3, args.reps // 2))
        rows.append((n, r, b, t))
        print(f"{n} workers: rlaunch {r[0]:.1f} ms, torchrun {t[0]:.1f} ms", file=sys.stderr)
    lines = [
        "# A worker crashes -> every worker running again, rlaunch vs torchrun",
        "",
        f"Measured {datetime.date.today()} on this project's machine (2 cores, 24 GiB), "
        f"`{os.path.relpath(__file__, ROOT)}`, "
        f"`--containment {args.containment}`: from rank 0's crash (exit 1) to the last worker of the "
        f"second attempt started; median of {args.reps} runs (torchrun: {max(3, args.reps // 2)}), min-max "
        "in brackets.",
        "",
        f"| workers | rlaunch |{f' {args.baseline_label} |' if args.baseline else ''} torchrun | torchrun / rlaunch |",
        "|---|---|---|---|" + ("---|" if args.baseline else ""),
    ]
    for n, r, b, t in rows:
        base_cell = f" {b[0]:.1f} ms ({b[1]:.1f}-{b[2]:.1f}) |" if b else ""
        lines.append(
            f"| {n} | {r[0]:.1f} ms ({r[1]:.1f}-{r[2]:.1f}) |{base_cell} {t[0]:.0f} ms ({t[1]:.0f}-{t[2]:.0f}) | {t[0] / r[0]:.1f}x |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
