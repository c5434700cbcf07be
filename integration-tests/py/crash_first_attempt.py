# Crashes rank 1 on the first attempt after joining the process group; the restarted group
# re-initialises against the same agent store and finishes.
import os
import sys
import torch
import torch.distributed as dist

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.ones(4)
dist.all_reduce(t)
assert torch.all(t == world)
if attempt == 0 and rank == 1:
    print("crashing on purpose", flush=True)
    os._exit(3)
if attempt == 0:
    # The other ranks block here until the agent stops them.
    dist.barrier()
    sys.exit("unreachable: rank 1 crashed")
dist.barrier()
print(f"finished rank={rank} attempt={attempt}", flush=True)
dist.destroy_process_group()
