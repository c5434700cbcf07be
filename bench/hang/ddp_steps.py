# A CPU DDP job (gloo) that trains for a fixed time and prints its steps per second; rank 0
# prints the job's figure. Unmodified torchrun-style script: no heartbeat, no rlaunch import.
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

seconds = float(sys.argv[1])
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for _ in range(20):  # warm-up
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
dist.barrier()
steps, start = 0, time.monotonic()
while True:
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    steps += 1
    # Every rank stops at the same step: rank 0 decides when the time is up.
    if steps % 50 == 0:
        done = torch.tensor([float(time.monotonic() - start >= seconds)])
        dist.broadcast(done, 0)
        if done.item():
            break
rate = steps / (time.monotonic() - start)
if dist.get_rank() == 0:
    print(f"steps_per_s {rate:.2f}", flush=True)
dist.barrier()
# torch 2.15's gloo DDP sometimes aborts in its destructors at exit ("terminate called without an
# active exception"), with or without rlaunch: leave without running them.
os._exit(0)
