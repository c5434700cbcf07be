"""The survivor benchmark's worker: DDP (gloo, CPU) on a small MLP under torch.compile, a
snapshot every step, about 8 steps a second.

    train.py OUT MODE STEPS     MODE: resilient (the training function under @rlaunch.resilient)
                                | plain (the same function, called as it is: every re-form
                                starts the process again) | disk (plain, rank 0 torch.save to
                                OUT/ckpt.pt every 50 steps: for torchrun)

Once per process: imports, the model, torch.compile (compiled at the first step). Each entry of
the function: the process group, DDP, the state. Appends to OUT/events.log, rank 0 only:
`step S t=<unix> loss=<exact> host=H world=W pid=P`, and at each entry `resume S ..`/`fresh 0 ..`;
`compiled t=..` after the first step of a process. Every rank appends to OUT/entries.log at each
entry: `entry host=H local_rank=L pid=P n=<this process's entries> t=<unix>`.
"""

import os
import sys
import time

import torch
import torch.distributed as dist

OUT, MODE, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
HOST = os.environ.get("BENCH_HOST", "?")
COMPILE = os.environ.get("BENCH_COMPILE", "1") == "1"
PAUSE = float(os.environ.get("BENCH_PAUSE", "0.08"))  # between steps (0: as fast as it goes)
# The compiled code saved and loaded with each snapshot (compiled=True)
HANDOVER = os.environ.get("BENCH_HANDOVER", "0") == "1"

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 16))
opt = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.9)
fast = torch.compile(model) if COMPILE else model
CKPT = os.path.join(OUT, "ckpt.pt")
compiled = False
entries = 0


def log(line):
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(OUT, "events.log"), "a") as f:
            f.write(f"{line} t={time.time():.6f} host={HOST} world={os.environ['WORLD_SIZE']} pid={os.getpid()}\n")


def train():
    global compiled, entries
    entries += 1
    rank = int(os.environ["RANK"])
    # Every rank: which process runs this entry (the benchmark kills host b's local rank 1 by it,
    # and tells which processes were kept).
    with open(os.path.join(OUT, "entries.log"), "a") as f:
        f.write(f"entry host={HOST} local_rank={os.environ['LOCAL_RANK']} pid={os.getpid()} n={entries} t={time.time():.6f}\n")
    dist.init_process_group("gloo")
    ddp = torch.nn.parallel.DistributedDataParallel(fast)
    start = 0
    if MODE in ("resilient", "plain"):
        import rlaunch

        got = rlaunch.snapshot.load(compiled=HANDOVER)
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
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x = torch.randn(64, 256, generator=g)
        y = torch.randint(0, 16, (64,), generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x), y)
        loss.backward()
        opt.step()
        if MODE != "disk":
            rlaunch.snapshot.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}, compiled=HANDOVER)
        elif step % 50 == 49 and rank == 0:
            torch.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": step}, CKPT + ".tmp")
            os.replace(CKPT + ".tmp", CKPT)
        if not compiled:
            compiled = True
            log("compiled 0")
        log(f"step {step} loss={loss.item()!r}")
        time.sleep(PAUSE)
    dist.barrier()
    log("done 0")
    dist.destroy_process_group()


if MODE == "resilient":
    import rlaunch

    rlaunch.resilient(train)()
else:
    train()
