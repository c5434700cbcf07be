"""A small data-parallel loop for the recovery benchmark: gloo all_reduce of a 64 KiB tensor
every 50 ms, forever. Appends events to OUT/events.log as `EVENT t=<unix time> host=..
rank=.. world=.. restart=..`: `start` when the process starts, `step1` when its first
all_reduce in this process group completed (the job is training again), `step` every 20 steps.
Under torchrun and under rlaunch alike (env:// with the agent's store)."""

import os
import sys
import time

OUT = sys.argv[1]
HOST = os.environ.get("BENCH_HOST", "?")
RANK = os.environ.get("RANK", "?")
WORLD = os.environ.get("WORLD_SIZE", "?")
RESTART = os.environ.get("TORCHELASTIC_RESTART_COUNT", "?")


def log(event):
    line = f"{event} t={time.time():.6f} host={HOST} rank={RANK} world={WORLD} restart={RESTART} pid={os.getpid()}\n"
    with open(os.path.join(OUT, "events.log"), "a") as f:
        f.write(line)


log("start")
import torch  # noqa: E402  (the import is part of a worker's start-up cost)
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo")
t = torch.ones(16384)
step = 0
while True:
    dist.all_reduce(t)
    t.fill_(1.0)
    step += 1
    if step == 1:
        log("step1")
    elif step % 20 == 0:
        log("step")
    time.sleep(0.05)
