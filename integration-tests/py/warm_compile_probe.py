# Whether inductor (what torch.compile imports) was imported before this program's first line, as
# JSON in $PROBE_DIR/rank{RANK}.compile.json. This program calls torch.compile, so its warm worker
# imports inductor ahead (warm_plain_probe.py, which does not, gets no such import).
import json
import os
import sys

import torch

WARM = b"rlaunch_warm.py" in open("/proc/self/cmdline", "rb").read()
AHEAD = "torch._inductor.compile_fx" in sys.modules
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{os.environ['RANK']}.compile.json"), "w") as f:
    json.dump({"warm": WARM, "inductor_ahead": AHEAD}, f)
model = torch.compile(torch.nn.Linear(2, 2))
