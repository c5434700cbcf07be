# `python -m warmpkg.probe`: warm_probe.py's probe, run as a module (the working directory,
# first on sys.path, holds warm_probe.py).
import json
import os
import sys

import torch  # noqa: F401
import warm_probe

# A worker that a warm interpreter became still has the bootstrap's command line.
WARM = b"rlaunch_warm.py" in open("/proc/self/cmdline", "rb").read()

if __name__ == "__main__":
    p = warm_probe.probe()
    p["warm"] = WARM
    p["main_is_this"] = vars(sys.modules["__main__"]) is globals()
    with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.mod.json"), "w") as f:
        json.dump(p, f, sort_keys=True)
