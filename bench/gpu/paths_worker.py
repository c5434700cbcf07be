"""The worker of bench/gpu/gpu_paths.py: the paths that landed after the last GPU check, on a GPU.

    rlaunch --standalone --nproc-per-node 1 --max-restarts 1 bench/gpu/paths_worker.py MODE OUT [options]

MODE:
  snap   a model and an Adam optimizer of about 1 GiB on the device: the time that
         `rlaunch.snapshot.save` blocks, against one device-to-host copy of the same bytes (into
         pageable and into pinned host memory) and `torch.save` to /dev/shm; then exit 1; the
         restarted attempt `load`s, puts the state back on the device and compares every byte.
  warm   a CUDA program that runs 8 s, then exits 1; the restarted attempt does its first CUDA
         step again. Each attempt records whether it started warm, whether CUDA had been
         initialised (libcuda mapped) before the program's first statement after its imports,
         the device it got, and when its first CUDA step ended.
  kill   PyTorch DDP on NCCL with a snapshot every step; the last rank SIGKILLs itself in step
         --kill-step (forward done, backward not begun) on the first attempt; the restarted
         group resumes from the snapshot: at the step it died in, its parameters equal, byte for
         byte, the ones saved for the step before.
  mlp    the `train` example's model in PyTorch (MLP dim-hidden-hidden-classes, ReLU, cross
         entropy, SGD with momentum, batches gathered on the host): DDP on NCCL, fp32 or bf16
         (autocast), steady steps/s after 20 warm-up steps, as `train` prints it.

Each attempt writes OUT/MODE.<attempt>.<rank>.json.
"""

import hashlib
import json
import os
import signal
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn

T_IMPORTED = time.time()
# GPU_PATHS_DRY=1: the same code on the CPU (gloo, no CUDA), to try the harness without a GPU.
DRY = os.environ.get("GPU_PATHS_DRY") == "1"
BACKEND = "gloo" if DRY else "nccl"


def device(index):
    return torch.device("cpu") if DRY else torch.device("cuda", index % torch.cuda.device_count())


def set_device(dev):
    if not DRY:
        torch.cuda.set_device(dev)


def sync():
    if not DRY:
        torch.cuda.synchronize()


def out_path(out, mode, attempt, rank):
    return os.path.join(out, f"{mode}.{attempt}.{rank}.json")


def digest(t):
    return hashlib.sha256(t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()).hexdigest()


def digests(state):
    """name -> sha256 of every tensor in a (nested) state, in a stable order."""
    res = {}

    def walk(prefix, v):
        if isinstance(v, torch.Tensor):
            res[prefix] = digest(v)
        elif isinstance(v, dict):
            for k in sorted(v, key=str):
                walk(f"{prefix}/{k}", v[k])
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)

    walk("", state)
    return res


def nbytes(state):
    return sum(
        t.numel() * t.element_size()
        for t in _tensors(state)
    )


def _tensors(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors(x)
    elif isinstance(v, (list, tuple)):
        for x in v:
            yield from _tensors(x)


def sync_timed(fn, reps):
    ts = []
    for _ in range(reps):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts), ts


def snap(out, attempt):
    import rlaunch

    dev = device(int(os.environ["LOCAL_RANK"]))
    set_device(dev)
    torch.manual_seed(0)
    width, depth = 4096, 5
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(dev)
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(256, width, device=dev)

    def step():
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    def state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    step()
    r = {"attempt": attempt, "device": "cpu" if DRY else torch.cuda.get_device_name(dev)}
    if attempt == 0:
        s = state()
        r["bytes"] = nbytes(s)
        on_dev = [t for t in _tensors(s) if t.is_cuda or (DRY and t.dim() > 0)]
        r["bytes_on_device"] = sum(t.numel() * t.element_size() for t in on_dev)
        pageable = [torch.empty_like(t, device="cpu") for t in on_dev]
        pinned = [torch.empty_like(t, device="cpu") if DRY else torch.empty_like(t, device="cpu").pin_memory() for t in on_dev]

        def copy_into(dst):
            for d, t in zip(dst, on_dev):
                d.copy_(t)

        r["d2h_pageable_s"], _ = sync_timed(lambda: copy_into(pageable), 5)
        r["d2h_pinned_s"], _ = sync_timed(lambda: copy_into(pinned), 5)
        del pageable, pinned
        saves, saved = [], {}
        for k in range(5):
            step()
            s = state()
            sync()
            t = time.perf_counter()
            ok = rlaunch.snapshot.save(k, s)
            saves.append(time.perf_counter() - t)
            assert ok, f"save of step {k} refused"
            if k == 4:  # the step the restarted attempt must restore
                saved[k] = digests(s)
        r["save_first_s"], r["save_s"], r["save_all_s"] = saves[0], statistics.median(saves[1:]), saves
        shm = f"/dev/shm/rlaunch-gpu-paths-{os.getpid()}.pt"
        r["torch_save_s"], _ = sync_timed(lambda: torch.save(state(), shm), 3)
        r["torch_save_file"] = shm
        json.dump(saved, open(os.path.join(out, "snap.digests.json"), "w"))
        json.dump(r, open(out_path(out, "snap", attempt, 0), "w"))
        sys.stdout.flush()
        os._exit(1)
    before = json.load(open(out_path(out, "snap", 0, 0)))
    saved = json.load(open(os.path.join(out, "snap.digests.json")))
    sync()
    t = time.perf_counter()
    got = rlaunch.snapshot.load()
    r["load_s"] = time.perf_counter() - t
    assert got is not None, "nothing restored"
    step_no, st = got
    model.load_state_dict(st["model"])
    opt.load_state_dict(st["optim"])
    sync()
    r["load_to_device_s"] = time.perf_counter() - t
    r["restored_step"] = step_no
    now = digests(state())
    want = saved[str(step_no)]
    r["tensors_compared"] = len(want)
    r["tensors_differing"] = sorted(k for k in want if now.get(k) != want[k])
    r["on_device_after_load"] = all(p.device == dev for p in model.parameters()) and all(
        t.device == dev for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    shm = before["torch_save_file"]
    sync()
    t = time.perf_counter()
    sd = torch.load(shm, map_location=dev)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["optim"])
    sync()
    r["torch_load_to_device_s"] = time.perf_counter() - t
    os.unlink(shm)
    json.dump(r, open(out_path(out, "snap", attempt, 0), "w"))


def _link(fd):
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def warm(out, attempt, run_s):
    # Before anything of the program touches CUDA: was it initialised already (by a warm
    # interpreter importing torch before its rank was known)?
    maps = open("/proc/self/maps").read()
    cmdline = open("/proc/self/cmdline", "rb").read()
    r = {
        "attempt": attempt,
        "t_imported": T_IMPORTED,
        "warm": b"rlaunch_warm" in cmdline,
        "libcuda_mapped_at_start": "libcuda.so" in maps,
        # A CUDA context opens the device files; loading libcuda (torch links it) does not.
        "device_files_open_at_start": sorted(
            {_link(fd) for fd in os.listdir("/proc/self/fd") if _link(fd).startswith("/dev/nvidia")}
        ),
        "cuda_initialised_at_start": torch.cuda.is_initialized(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    dev = torch.device("cpu") if DRY else torch.device("cuda", r["local_rank"])
    set_device(dev)
    x = torch.randn(2048, 2048, device=dev)
    y = (x @ x).sum().item()
    r["t_first_cuda_step"] = time.time()
    r["current_device"] = r["local_rank"] if DRY else torch.cuda.current_device()
    r["device_count"] = 0 if DRY else torch.cuda.device_count()
    r["device_uuid"] = "cpu" if DRY else str(torch.cuda.get_device_properties(dev).uuid)
    r["checksum"] = y
    if attempt == 0:
        end = time.time() + run_s
        while time.time() < end:
            (x @ x).sum().item()
            time.sleep(0.01)
        r["t_exit"] = time.time()
        json.dump(r, open(out_path(out, "warm", attempt, r["local_rank"]), "w"))
        sys.stdout.flush()
        os._exit(1)
    json.dump(r, open(out_path(out, "warm", attempt, r["local_rank"]), "w"))


def mlp_model(dim, hidden, classes, seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def blobs(samples, dim, classes):
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, dim, generator=g) * 0.6
    y = torch.randint(0, classes, (samples,), generator=g)
    x = centres[y] + torch.randn(samples, dim, generator=g)
    return x, y


def process_group():
    """This rank's device (its LOCAL_RANK's) and a process group on it, as torchrun gives one."""
    dev = device(int(os.environ["LOCAL_RANK"]))
    set_device(dev)
    dist.init_process_group(BACKEND, **({} if DRY else {"device_id": dev}))
    return dev, dist.get_rank(), dist.get_world_size()


def kill(out, attempt, a):
    import rlaunch
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev, rank, world = process_group()
    model = mlp_model(64, 1024, 8, 1234).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = blobs(16384, 64, 8)
    start = 0
    r = {"attempt": attempt, "rank": rank, "world": world, "nccl": [0] if DRY else list(torch.cuda.nccl.version())}
    t = time.perf_counter()
    got = rlaunch.snapshot.load()
    r["load_s"] = time.perf_counter() - t
    if got is not None:
        step_no, st = got
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["optim"])
        start = step_no + 1
        r["restored_step"] = step_no
        r["restored_digest"] = hashlib.sha256(
            b"".join(digest(p).encode() for p in model.parameters())
        ).hexdigest()
    ddp = DDP(model, device_ids=None if DRY else [dev.index])
    r["start"] = start
    saved = {}
    lossf = nn.CrossEntropyLoss()
    for step in range(start, a.steps):
        idx = torch.randint(0, x.shape[0], (256,), generator=torch.Generator().manual_seed(step * world + rank))
        xb, yb = x[idx].to(dev), y[idx].to(dev)
        opt.zero_grad(set_to_none=True)
        loss = lossf(ddp(xb), yb)
        if attempt == 0 and step == a.kill_step and rank == world - 1:
            r["killed_in_step"] = step
            json.dump(r | {"saved": saved}, open(out_path(out, "kill", attempt, rank), "w"))
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        loss.backward()
        opt.step()
        assert rlaunch.snapshot.save(step, {"model": model.state_dict(), "optim": opt.state_dict()}), step
        if step >= a.kill_step - 3:
            saved[step] = hashlib.sha256(b"".join(digest(p).encode() for p in model.parameters())).hexdigest()
        r["last_loss"] = loss.item()
    r["steps_done"] = a.steps - start
    r["saved"] = saved
    json.dump(r, open(out_path(out, "kill", attempt, rank), "w"))
    dist.destroy_process_group()


def mlp(out, attempt, a):
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev, rank, world = process_group()
    model = mlp_model(a.dim, a.hidden, a.classes, 0).to(dev)
    ddp = DDP(model, device_ids=None if DRY else [dev.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = blobs(16384, a.dim, a.classes)
    lossf = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(rank)
    perm = torch.randperm(x.shape[0], generator=g)
    per_epoch = x.shape[0] // a.batch_size
    bf16 = a.precision == "bf16"
    t_steady = None
    losses = []
    for step in range(a.steps):
        if step == 20:
            sync()
            t_steady = time.perf_counter()
        pos = step % per_epoch
        idx = perm[pos * a.batch_size:(pos + 1) * a.batch_size]
        xb, yb = x[idx].to(dev), y[idx].to(dev)  # gathered on the host, as train does
        opt.zero_grad(set_to_none=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            loss = lossf(ddp(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())  # train reads each step's loss back too
    sync()
    sps = (a.steps - 20) / (time.perf_counter() - t_steady)
    r = {"attempt": attempt, "rank": rank, "world": world, "precision": a.precision, "dim": a.dim, "hidden": a.hidden,
         "batch": a.batch_size, "steps": a.steps, "steady_steps_per_s": sps, "first_loss": losses[0], "last_loss": losses[-1]}
    print(f"torch-mlp: steady: {sps:.1f} steps/s precision {a.precision} batch {a.batch_size}/rank world {world}", flush=True)
    json.dump(r, open(out_path(out, f"mlp-{a.precision}-{a.hidden}", attempt, rank), "w"))
    dist.destroy_process_group()


def main():
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["snap", "warm", "kill", "mlp"])
    p.add_argument("out")
    p.add_argument("--run-s", type=float, default=8.0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--kill-step", type=int, default=150)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--classes", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    a = p.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if a.mode == "snap":
        snap(a.out, attempt)
    elif a.mode == "warm":
        warm(a.out, attempt, a.run_s)
    elif a.mode == "kill":
        kill(a.out, attempt, a)
    else:
        mlp(a.out, attempt, a)


if __name__ == "__main__":
    main()
