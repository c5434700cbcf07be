"""The compiled code handed over with a snapshot (`save(..., compiled=True)`,
`load(..., compiled=True)`), two ranks on one node.

    compiled_handover.py OUT MODE         MODE: on | off (the flag given to save and load)

Every attempt compiles into an inductor cache of its own (OUT/cache.ATTEMPT, shared by its two
ranks as a host's is) and a temporary directory of its own (OUT/tmp.ATTEMPT, where inductor
keeps its precompiled header), as a new host would, and with OUT/bin/g++ as its
C++ compiler: a wrapper that appends each compile (not a version query, not a query of its
target options, not a preprocessing `-E`, which inductor runs to name its precompiled header) to
OUT/compiles.ATTEMPT and runs the real g++.

The first attempt trains one step of an MLP under torch.compile, saves it, and exits 3 (all
ranks, once every one has saved). The second (the agent's restart) loads it, trains one step,
saves it and exits 3 too; the third loads the second's and trains one step: the second hands on
what it was handed. Each restarted attempt prints, per rank, `attempt A rank R hits=H misses=M
aot_hits=A installed=I first_step=S` (inductor's FX graph cache, AOTAutograd's cache, whether
compiled code was installed, the first step's seconds).
"""

import os
import sys
import time

OUT, MODE = sys.argv[1], sys.argv[2]
RANK = int(os.environ["RANK"])
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
BIN = os.path.join(OUT, "bin")
if not os.path.exists(os.path.join(BIN, "g++")):
    os.makedirs(BIN, exist_ok=True)
    tmp = os.path.join(BIN, f"g++.{RANK}")
    with open(tmp, "w") as f:
        f.write(
            "#!/bin/sh\n"
            'case " $* " in *" -v "*|*" --version "*|*" -dumpversion "*|*" -dumpfullversion "*|*" -E "*|*" --help=target "*) ;;\n'
            f'  *) echo "$*" >> "{OUT}/compiles.$RLAUNCH_TEST_ATTEMPT" ;;\nesac\n'
            'exec g++ "$@"\n'
        )
    os.chmod(tmp, 0o755)
    os.replace(tmp, os.path.join(BIN, "g++"))
os.environ["CXX"] = os.path.join(BIN, "g++")
os.environ["RLAUNCH_TEST_ATTEMPT"] = str(ATTEMPT)
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(OUT, f"cache.{ATTEMPT}")
os.environ["TMPDIR"] = os.path.join(OUT, f"tmp.{ATTEMPT}")
os.makedirs(os.environ["TMPDIR"], exist_ok=True)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import rlaunch  # noqa: E402

on = MODE == "on"
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
fast = torch.compile(model)
dist.init_process_group("gloo")


def step(n):
    g = torch.Generator().manual_seed(n * 10 + RANK)
    x, y = torch.randn(8, 32, generator=g), torch.randint(0, 4, (8,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(fast(x), y)
    loss.backward()
    opt.step()


if ATTEMPT == 0:
    step(0)
    assert rlaunch.snapshot.save(0, {"model": model.state_dict()}, compiled=on)
    dist.barrier()
    sys.exit(3)

got = rlaunch.snapshot.load(compiled=on)
assert got is not None and got[0] == ATTEMPT - 1, got
model.load_state_dict(got[1]["model"])
installed = rlaunch.compiled._installed
t = time.monotonic()
step(ATTEMPT)
first = time.monotonic() - t
from torch._dynamo.utils import counters  # noqa: E402

print(f"attempt {ATTEMPT} rank {RANK} hits={counters['inductor']['fxgraph_cache_hit']} "
      f"misses={counters['inductor']['fxgraph_cache_miss']} "
      f"aot_hits={counters['aot_autograd']['autograd_cache_hit']} installed={installed} "
      f"first_step={first:.2f}", flush=True)
assert rlaunch.snapshot.save(ATTEMPT, {"model": model.state_dict()}, compiled=on)
dist.barrier()
if ATTEMPT == 1:
    sys.exit(3)
dist.destroy_process_group()
