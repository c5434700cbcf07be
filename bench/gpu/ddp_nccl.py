"""An unmodified torchrun-style PyTorch DDP script on the NCCL backend, for the GPU check.

    torchrun --standalone --nproc-per-node 2 bench/gpu/ddp_nccl.py --steps 200
    rlaunch  --standalone --nproc-per-node 2 bench/gpu/ddp_nccl.py --steps 200

It reads only what torchrun gives a worker (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT
through init_process_group's env:// rendezvous, TORCHELASTIC_RESTART_COUNT), picks its GPU from
LOCAL_RANK (modulo the GPUs visible, so several ranks may share one GPU where NCCL allows it),
trains an MLP on Gaussian blobs, checks that the loss fell and that every rank holds the same
parameters, and prints one result line per rank.

Fault hook: `--kill-rank R --kill-step S` makes rank R SIGKILL itself in the middle of step S
(after its forward pass, before the backward pass whose all-reduce its peers are already
waiting in) on the first attempt only. With `--ckpt DIR` rank 0 saves every `--ckpt-every`
steps and every attempt resumes from the last save, so a restarted group finishes the job.
"""

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--ckpt-every", type=int, default=20)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    a = p.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    ngpu = torch.cuda.device_count()
    assert ngpu > 0, "no GPU visible"
    device = torch.device("cuda", local_rank % ngpu)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    assert dist.get_backend() == "nccl", dist.get_backend()

    g = torch.Generator().manual_seed(0)
    centres = torch.randn(a.classes, a.dim, generator=g) * 0.6
    torch.manual_seed(1234 + rank)  # different init per rank: DDP broadcasts rank 0's
    model = nn.Sequential(
        nn.Linear(a.dim, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.hidden), nn.ReLU(), nn.Linear(a.hidden, a.classes)
    ).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=a.lr, momentum=0.9)
    start = 0
    ckpt = os.path.join(a.ckpt, "ckpt.pt") if a.ckpt else None
    if ckpt and os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu")  # load_state_dict moves it to the GPU
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
    ddp = DDP(model, device_ids=[device.index])
    if rank == 0:
        print(
            f"ddp-nccl: world {world} restart {restart} resume step {start} nccl {torch.cuda.nccl.version()} "
            f"device {torch.cuda.get_device_name(device)}",
            flush=True,
        )

    centres = centres.to(device)
    gen = torch.Generator(device=device)
    losses, t0 = [], None
    for step in range(start, a.steps):
        if step == start + a.warmup:
            torch.cuda.synchronize()
            t0, timed_from = time.perf_counter(), step
        sg = gen.manual_seed(step * 1000 + rank)  # made on the GPU: no host work in the step
        y = torch.randint(0, a.classes, (a.batch_size,), generator=sg, device=device)
        x = centres[y] + torch.randn(a.batch_size, a.dim, generator=sg, device=device)
        loss = nn.functional.cross_entropy(ddp(x), y)
        if restart == 0 and rank == a.kill_rank and step == a.kill_step:
            print(f"ddp-nccl: rank {rank} kills itself in step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        if ckpt and rank == 0 and (step + 1) % a.ckpt_every == 0:
            tmp = ckpt + ".tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            os.replace(tmp, ckpt)
    torch.cuda.synchronize()
    rate = (a.steps - timed_from) / (time.perf_counter() - t0) if t0 is not None else float("nan")

    flat = torch.cat([q.detach().flatten() for q in model.parameters()])
    gathered = [torch.zeros_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    assert all(torch.equal(gathered[0], q) for q in gathered), "parameters differ across ranks"
    if not a.ckpt or start == 0:
        head = sum(losses[:10]) / len(losses[:10])
        tail = sum(losses[-10:]) / len(losses[-10:])
        assert tail < 0.8 * head, f"loss did not fall: {head:.4f} -> {tail:.4f}"
    print(
        f"ddp-nccl ok rank={rank} world={world} local_rank={local_rank} device={device} restart={restart} "
        f"steps={a.steps - start} first_loss={losses[0]:.4f} last_loss={losses[-1]:.4f} steps_per_s={rate:.1f}",
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
