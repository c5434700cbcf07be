"""The benchmark's worker: PyTorch DDP (gloo) on a small MLP, a snapshot in the agents' memory
every step (rlaunch.snapshot; under torchrun it does nothing and the job starts again from step
0). Each completed step appends `attempt step unix_time` to $BENCH_DIR/steps.{rank}. In the
first attempt, rank $CRASH_RANK exits at step $CRASH_STEP after writing `crash` with the time."""

import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import rlaunch


def main():
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    rank = int(os.environ["RANK"])
    out = os.environ["BENCH_DIR"]
    steps = int(os.environ.get("STEPS", "120"))
    crash_step, crash_rank = int(os.environ.get("CRASH_STEP", "40")), int(os.environ.get("CRASH_RANK", "1"))
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    start = 0
    got = rlaunch.snapshot.load()
    if got is not None:
        step, state = got
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = step + 1
    ddp = nn.parallel.DistributedDataParallel(model)
    g = torch.Generator().manual_seed(rank)
    log = open(os.path.join(out, f"steps.{rank}"), "a", buffering=1)
    for step in range(start, steps):
        if attempt == 0 and rank == crash_rank and step == crash_step:
            with open(os.path.join(out, "crash"), "w") as f:
                f.write(f"{time.time()}\n")
            os._exit(1)
        x = torch.randn(64, 256, generator=g)
        y = torch.randint(0, 10, (64,), generator=g)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        rlaunch.snapshot.save(step, {"model": model.state_dict(), "opt": opt.state_dict()})
        log.write(f"{attempt} {step} {time.time()}\n")
        time.sleep(0.02)
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
