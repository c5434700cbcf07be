# warm_compile_probe.py's probe in a program that never compiles: nothing of inductor is imported
# ahead for it. Writes $PROBE_DIR/rank{RANK}.plain.json.
import json
import os
import sys

import torch

WARM = b"rlaunch_warm.py" in open("/proc/self/cmdline", "rb").read()
AHEAD = "torch._inductor.compile_fx" in sys.modules
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.plain.json"), "w") as f:
    json.dump({"warm": WARM, "inductor_ahead": AHEAD, "torch": torch.__version__}, f)
