"""Time from launch to the first `\\r` progress update on a terminal, rlaunch vs torchrun.

Each launcher runs on a pseudo-terminal (as from a shell) with 2 workers of
progress_worker.py, which writes `\\rstep i/30` every 0.1 s without a newline; the
clock stops when `step 1/` appears on the terminal. Usage, from the repository root:

    PYTHON_EXEC=.venv/bin/python .venv/bin/python bench/terminal/first_update.py \\
        target/debug/rlaunch .venv/bin/torchrun
"""
import os, pty, select, statistics, sys, time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "progress_worker.py")


def first_update(argv, deadline_s=30.0):
    t0 = time.monotonic()
    pid, fd = pty.fork()
    if pid == 0:
        os.execvp(argv[0], argv)
    buf, first = b"", None
    while True:
        ready, _, _ = select.select([fd], [], [], deadline_s)
        if not ready:
            break
        try:
            data = os.read(fd, 4096)
        except OSError:  # EIO: the launcher closed the terminal
            break
        if not data:
            break
        buf += data
        if first is None and b"step 1/" in buf:
            first = time.monotonic() - t0
    os.waitpid(pid, 0)
    if first is None:
        sys.exit(f"{argv[0]}: no progress update within {deadline_s} s")
    return first


def main():
    launchers = {"rlaunch": sys.argv[1], "torchrun": sys.argv[2]}
    runs = {
        name: [first_update([exe, "--standalone", "--nproc-per-node", "2", WORKER]) for _ in range(5)]
        for name, exe in launchers.items()
    }
    print("| launcher | first progress update (median of 5, s) | runs |")
    print("|---|---|---|")
    for name, v in runs.items():
        print(f"| {name} | {statistics.median(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    ratio = statistics.median(runs["torchrun"]) / statistics.median(runs["rlaunch"])
    print(f"\ntorchrun / rlaunch: {ratio:.1f}x")


if __name__ == "__main__":
    main()
