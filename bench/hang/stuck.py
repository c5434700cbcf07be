# Rank 1 gets stuck after printing the time; the others wait in all_reduce.
import time
from datetime import timedelta

import torch
import torch.distributed as dist

dist.init_process_group("gloo", timeout=timedelta(hours=1))
t = torch.ones(1)
dist.all_reduce(t)
if dist.get_rank() == 1:
    print(f"stuck_at {time.time():.3f}", flush=True)
    time.sleep(3600)
dist.all_reduce(t)
