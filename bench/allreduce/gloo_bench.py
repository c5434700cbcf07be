"""torch.distributed gloo all-reduce benchmark, measured exactly like examples/allreduce_bench.rs:
f32 sum, sizes doubling from --min to --max bytes, iters = clamp(2e8 / bytes, 3, 1000),
warm-up iters/10 (>= 2), best of 3 rounds, each round the slowest rank's average time.
Ranks are started with multiprocessing (spawn) and meet through a TCP init method."""

import argparse
import json
import os
import socket
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROUNDS = 3


def worker(rank, world, port, args):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    out = open(args.json, "a") if (args.json and rank == 0) else None
    if rank == 0:
        print(f"# torch {torch.__version__} gloo all_reduce f32 sum, {world} ranks")
        print(f"{'bytes':>12} {'iters':>10} {'time(us)':>12} {'algbw(GB/s)':>10} {'busbw(GB/s)':>10}")
    nbytes = max(args.min, 4)
    while nbytes <= args.max:
        t = torch.ones(nbytes // 4, dtype=torch.float32)
        iters = min(max(200_000_000 // nbytes, 3), 1000)
        for _ in range(max(iters // 10, 2)):
            dist.all_reduce(t)
        best = float("inf")
        for _ in range(ROUNDS):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                dist.all_reduce(t)
            s = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64)
            dist.all_reduce(s, op=dist.ReduceOp.MAX)
            best = min(best, s.item())
        algbw = nbytes / best / 1e9
        busbw = algbw * 2 * (world - 1) / world
        if rank == 0:
            print(f"{nbytes:>12} {iters:>10} {best * 1e6:>12.2f} {algbw:>10.3f} {busbw:>10.3f}", flush=True)
            if out:
                out.write(json.dumps({"impl": "gloo", "ranks": world, "bytes": nbytes, "time_us": best * 1e6, "algbw": algbw, "busbw": busbw}) + "\n")
                out.flush()
        nbytes *= 2
    dist.destroy_process_group()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def size(s):
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1].upper(), 1)
    return int(s[:-1] if mul > 1 else s) * mul


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--min", type=size, default=1 << 10)
    p.add_argument("--max", type=size, default=256 << 20)
    p.add_argument("--json")
    a = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.spawn(worker, args=(a.ranks, free_port(), a), nprocs=a.ranks, join=True)
