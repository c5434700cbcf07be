"""The node-loss benchmark's worker: DDP (gloo, CPU) on a small MLP, about 10 steps a second.

    train_ddp.py OUT MODE STEPS     MODE: snapshot (rlaunch.snapshot every step) | disk
                                    (rank 0 torch.save to OUT/ckpt.pt every 50 steps)

Resumes from what MODE keeps. Appends to OUT/events.log, per step and rank 0 only:
`step S t=<unix time> loss=<exact> host=H world=W` and at start `resume S t=..` / `fresh t=..`.
Deterministic: a step's loss is the same whenever it is computed.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

OUT, MODE, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
RANK = int(os.environ["RANK"])
HOST = os.environ.get("BENCH_HOST", "?")


def log(line):
    if RANK == 0:
        with open(os.path.join(OUT, "events.log"), "a") as f:
            f.write(f"{line} t={time.time():.6f} host={HOST} world={os.environ['WORLD_SIZE']}\n")


dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
CKPT = os.path.join(OUT, "ckpt.pt")

start = 0
if MODE == "snapshot":
    import rlaunch

    got = rlaunch.snapshot.load()
    if got:
        step, state = got
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        start = step + 1
elif os.path.exists(CKPT):
    state = torch.load(CKPT)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    start = state["step"] + 1
log(f"resume {start - 1}" if start else "fresh 0")

for step in range(start, STEPS):
    g = torch.Generator().manual_seed(step * 1000 + RANK)
    x = torch.randn(64, 256, generator=g)
    y = torch.randint(0, 16, (64,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    if MODE == "snapshot":
        rlaunch.snapshot.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    elif step % 50 == 49 and RANK == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, CKPT + ".tmp")
        os.replace(CKPT + ".tmp", CKPT)
    log(f"step {step} loss={loss.item()!r}")
    time.sleep(0.08)
dist.barrier()
log("done 0")
