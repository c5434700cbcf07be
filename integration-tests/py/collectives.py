# Unmodified torchrun-style script: gloo through env://, checks collective results on every rank.
import os
import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env:// from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
rank, world = dist.get_rank(), dist.get_world_size()
assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])

t = torch.full((1000,), float(rank + 1))
dist.all_reduce(t)
assert torch.all(t == world * (world + 1) / 2), t[:4]

b = torch.arange(10, dtype=torch.float32) if rank == 0 else torch.zeros(10)
dist.broadcast(b, src=0)
assert torch.equal(b, torch.arange(10, dtype=torch.float32))

parts = [torch.zeros(3) for _ in range(world)]
dist.all_gather(parts, torch.full((3,), float(rank)))
assert all(torch.all(p == i) for i, p in enumerate(parts))

dist.barrier()
print(f"collectives ok rank={rank} world={world}", flush=True)
dist.destroy_process_group()
