"""The model, data and optimizer of examples/train.rs, under PyTorch DDP (gloo), for a
steps/s comparison: MLP dim -> hidden -> hidden -> classes with ReLU, softmax cross-entropy,
SGD with momentum, Gaussian-blob data, DistributedSampler, per-rank batch --batch-size.

    torchrun --standalone --nproc-per-node 4 bench/train/ddp_torch.py --steps 300
"""

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--samples", type=int, default=16384)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--warmup", type=int, default=20)
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(a.classes, a.dim, generator=g) * 0.6
    y = torch.randint(0, a.classes, (a.samples,), generator=g)
    x = centres[y] + torch.randn(a.samples, a.dim, generator=g)
    ds = TensorDataset(x, y)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, seed=0)
    loader = DataLoader(ds, batch_size=a.batch_size, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(a.dim, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.classes)))
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    step, epoch, t0, losses = 0, 0, None, []
    while step < a.steps:
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if step == a.warmup:
                dist.barrier()
                t0 = time.perf_counter()
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            step += 1
            if step >= a.steps:
                break
        epoch += 1
    dist.barrier()
    secs = time.perf_counter() - t0
    if rank == 0:
        n = a.steps - a.warmup
        print(f"torch {torch.__version__} DDP gloo: world {world} batch {a.batch_size}/rank: "
              f"loss {sum(losses[:10]) / 10:.3f} -> {sum(losses[-10:]) / 10:.3f}; "
              f"steady: {n / secs:.1f} steps/s ({n * a.batch_size * world / secs:.0f} samples/s, steps {a.warmup}..{a.steps})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
