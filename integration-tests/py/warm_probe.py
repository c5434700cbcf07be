# What a worker sees of itself, as JSON in $PROBE_DIR/rank{RANK}[.mod].json: whether it was a
# warm interpreter (its command line is the bootstrap's), its environment, argv, path,
# working directory, __main__, signal dispositions, descriptors and process group. Run as a
# script, or as `-m warmpkg.probe` (then PROBE_MODULE=1).
import json
import os
import signal
import sys

import torch  # noqa: F401  (what a warm worker imports ahead)

# A worker that a warm interpreter became still has the bootstrap's command line.
WARM = b"rlaunch_warm.py" in open("/proc/self/cmdline", "rb").read()


def probe():
    main = sys.modules["__main__"]
    return {
        "warm": WARM,
        "env": dict(os.environ),
        "argv": sys.argv,
        "orig_argv": getattr(sys, "orig_argv", None),
        "path": sys.path,
        "cwd": os.getcwd(),
        "main_names": sorted(k for k in vars(main) if not k.startswith("_") or k.startswith("__")),
        "main_file": getattr(main, "__file__", None),
        "main_spec": repr(getattr(main, "__spec__", None) and main.__spec__.name),
        "main_is_this": vars(main) is globals(),
        "signals": {
            str(s): repr(signal.getsignal(s))
            for s in range(1, 32)
            if s not in (signal.SIGKILL, signal.SIGSTOP)
        },
        "blocked": sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])),
        "fds": sorted(int(f) for f in os.listdir("/proc/self/fd")),
        "own_group": os.getpgrp() == os.getpid(),
        "flags": repr(sys.flags),
        "stdin_tty": os.isatty(0),
        "umask": os.umask(0o22),
    }


if __name__ == "__main__":
    p = probe()
    # The descriptor listing itself opens one: leave it out.
    p["fds"] = p["fds"][:-1]
    suffix = ".mod" if os.environ.get("PROBE_MODULE") else ""
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}{suffix}.json"), "w") as f:
        json.dump(p, f, sort_keys=True)
