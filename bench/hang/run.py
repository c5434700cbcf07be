"""Hang detection's cost and speed, measured in one run.

1. Steps per second of a 2-rank PyTorch DDP job (gloo, CPU) under `rlaunch --standalone`, without
   and with `--hang-timeout 60`, alternating, and the agent's (rlaunch's) CPU time per second of
   the job while it samples.
2. Time from a rank getting stuck to the hang report, with `--hang-timeout T`: the report should
   come T plus at most a couple of sampling periods after.

Usage (from the repository root, after `cargo build --release -p rlaunch-launcher`):
    .venv/bin/python bench/hang/run.py [--rounds 3] [--seconds 15] [--out bench/hang/RESULTS.md]
"""

import argparse
import datetime
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RLAUNCH = os.path.join(ROOT, "target/release/rlaunch")
PYTHON = os.path.join(ROOT, ".venv/bin/python")
HERE = os.path.join(ROOT, "bench/hang")


def cpu_seconds(pid):
    """User + system CPU of one process (not its children), from /proc."""
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def run_job(seconds, hang_timeout):
    args = [RLAUNCH, "--standalone", "--nproc-per-node", "2"]
    if hang_timeout:
        args += ["--hang-timeout", str(hang_timeout)]
    args += [os.path.join(HERE, "ddp_steps.py"), str(seconds)]
    env = dict(os.environ, RLAUNCH_PYTHON=PYTHON, RLAUNCH_LOG="warn")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    last = [0.0]

    def sample():
        while p.poll() is None:
            try:
                last[0] = cpu_seconds(p.pid)
            except (OSError, IndexError, ValueError):
                pass
            time.sleep(0.2)

    t = threading.Thread(target=sample)
    t.start()
    out, err = p.communicate(timeout=seconds + 120)
    t.join()
    m = re.search(r"steps_per_s ([0-9.]+)", out)
    if p.returncode != 0 or not m:
        sys.exit(f"job failed ({p.returncode}):\n{out}\n{err}")
    return float(m.group(1)), last[0]


def time_to_report(timeout):
    args = [RLAUNCH, "--standalone", "--nproc-per-node", "3", "--hang-timeout", str(timeout),
            "--shutdown-timeout", "2", os.path.join(HERE, "stuck.py")]
    env = dict(os.environ, RLAUNCH_PYTHON=PYTHON, RLAUNCH_LOG="warn")
    p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout + 120)
    stuck = re.search(r"stuck_at ([0-9.]+)", p.stdout)
    hang = re.search(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z\s+WARN.*hang: no progress", p.stderr)
    if not stuck or not hang or "rank 1: <module> (stuck.py:" not in p.stderr:
        sys.exit(f"no hang report:\n{p.stdout}\n{p.stderr}")
    reported = datetime.datetime.fromisoformat(hang.group(1)[:26]).replace(tzinfo=datetime.timezone.utc).timestamp()
    return reported - float(stuck.group(1))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=15)
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    a = ap.parse_args()
    if not os.path.exists(RLAUNCH):
        sys.exit(f"{RLAUNCH} is missing: cargo build --release -p rlaunch-launcher")
    off, on, agent_off, agent_on = [], [], [], []
    for r in range(a.rounds):
        for hang in (None, 60) if r % 2 == 0 else (60, None):
            rate, cpu = run_job(a.seconds, hang)
            (on if hang else off).append(rate)
            (agent_on if hang else agent_off).append(cpu / a.seconds)
            print(f"round {r + 1} hang_timeout={hang}: {rate:.1f} steps/s, agent {cpu:.2f} s CPU", flush=True)
    ratios = [b / a for a, b in zip(off, on)]
    reports = [(t, time_to_report(t)) for t in (3, 5, 10)]
    m_off, m_on = statistics.median(off), statistics.median(on)
    lines = [
        "# Hang detection: cost and time to the report",
        "",
        f"Date: {datetime.date.today()}. Machine: {os.cpu_count()} cores, {platform.machine()}, "
        f"{platform.python_version()} with torch. Command: `.venv/bin/python bench/hang/run.py "
        f"--rounds {a.rounds} --seconds {a.seconds:g}` (rlaunch built with `--release`).",
        "",
        f"A 2-rank PyTorch DDP job (gloo, CPU, one thread per rank; `bench/hang/ddp_steps.py`) trains for "
        f"{a.seconds:g} s under `rlaunch --standalone`, without and with `--hang-timeout 60`, alternating, "
        f"{a.rounds} runs each. The agent's CPU is rlaunch's own process (it samples the workers once a second).",
        "",
        "| hang detection | steps/s (median) | runs | agent CPU (share of a core) |",
        "|---|---|---|---|",
        f"| off | {m_off:.1f} | {', '.join(f'{x:.1f}' for x in off)} | {statistics.median(agent_off) * 100:.2f} % |",
        f"| on (`--hang-timeout 60`) | {m_on:.1f} | {', '.join(f'{x:.1f}' for x in on)} | {statistics.median(agent_on) * 100:.2f} % |",
        f"| on / off | {m_on / m_off:.3f} (medians); per round, each pair run back to back: median "
        f"{statistics.median(ratios):.3f}, {min(ratios):.3f}–{max(ratios):.3f} | | |",
        "",
        "Time from rank 1 getting stuck (`bench/hang/stuck.py`: it prints the time, then sleeps; ranks 0 and 2 wait "
        "in `all_reduce`) to the agent's hang report (its log line's time), with every rank's stack read by py-spy:",
        "",
        "| --hang-timeout | stuck → report | beyond the timeout |",
        "|---|---|---|",
    ]
    for t, took in reports:
        lines.append(f"| {t} s | {took:.2f} s | {took - t:.2f} s |")
    lines += [
        "",
        "No peer is measured: torchrun has no hang detection (a hang lasts until the collective's own timeout, "
        "10-30 minutes by default, and is then reported as that rank's error).",
        "",
    ]
    text = "\n".join(lines)
    print(text)
    with open(a.out, "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
