"""What a snapshot costs: `rlaunch.snapshot.save` against one memcpy of the same state, against
`torch.save` to a tmpfs file and `torch.distributed.checkpoint.async_save`; `load` against
`torch.load` of that file; training with a snapshot every step against without.

Run: .venv/bin/python bench/snapshot/cost.py [--mib 256] [--out bench/snapshot/COST.md]
It starts itself under `rlaunch --standalone --nproc-per-node 1 --max-restarts 1`: the first
attempt saves and measures, then exits 1; the restarted one loads what the agent kept.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SHM = "/dev/shm"


def timed(fn, reps):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def state_of(mib):
    import torch
    n = 16
    per = mib * (1 << 20) // 4 // n
    g = torch.Generator().manual_seed(0)
    return {f"layer{i}.weight": torch.randn(per, generator=g) for i in range(n)}


def child(out, mib, reps):
    import torch
    import torch.distributed as dist
    import rlaunch

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    state = state_of(mib)
    path = os.path.join(SHM, f"rlaunch-bench-{os.getpid() if attempt == 0 else 'x'}.pt")
    fixed = os.path.join(out, "torch_save_path")
    r = {}
    if attempt == 0:
        dst = {k: torch.zeros_like(v) for k, v in state.items()}

        def memcpy():
            for k, v in state.items():
                dst[k].copy_(v)

        memcpy()
        r["memcpy"] = timed(memcpy, reps)
        r["save_first"] = timed(lambda: rlaunch.snapshot.save(0, state), 1)
        steps = iter(range(1, 1000))
        r["save"] = timed(lambda: rlaunch.snapshot.save(next(steps), state), reps)
        r["torch_save"] = timed(lambda: torch.save(state, path), reps)
        with open(fixed, "w") as f:
            f.write(path)
        dist.init_process_group("gloo")
        import torch.distributed.checkpoint as dcp
        blocking, total = [], []
        for i in range(reps):
            d = tempfile.mkdtemp(prefix="rlaunch-bench-dcp-", dir=SHM)
            t = time.perf_counter()
            fut = dcp.async_save({"state": state}, checkpoint_id=d)
            blocking.append(time.perf_counter() - t)
            fut.result()
            total.append(time.perf_counter() - t)
            subprocess.run(["rm", "-rf", d])
        r["dcp_async_blocking"], r["dcp_async_total"] = statistics.median(blocking), statistics.median(total)
        # Training: a linear layer whose parameters and momentum are `mib` MiB together.
        d_in = 4096
        d_out = mib * (1 << 20) // 4 // 2 // d_in
        model = torch.nn.Linear(d_in, d_out, bias=False)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        x = torch.randn(256, d_in)

        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()

        for _ in range(2):
            step()
        n = max(reps, 9)
        k = iter(range(2000, 3000))

        def step_and_save():
            step()
            rlaunch.snapshot.save(next(k), {"model": model.state_dict(), "optim": opt.state_dict()})

        step_and_save()
        # Alternated, so that the machine's drift falls on both alike.
        plain, snap = [], []
        for _ in range(n):
            plain.append(timed(step, 1))
            snap.append(timed(step_and_save, 1))
        r["train_step"], r["train_step_snapshot"] = statistics.median(plain), statistics.median(snap)
        r["train_save"] = timed(lambda: rlaunch.snapshot.save(next(k), {"model": model.state_dict(), "optim": opt.state_dict()}), n)
        r["train_mib"] = d_in * d_out * 4 * 2 / (1 << 20)
        # What the restarted attempt restores: the state measured above.
        rlaunch.snapshot.save(9999, state)
        json.dump(r, open(os.path.join(out, "attempt0.json"), "w"))
        sys.stdout.flush()
        os._exit(1)
    path = open(fixed).read().strip()
    names = list(state)

    def touch(sd):
        # Every byte read once into the program's own tensors (what load_state_dict does).
        for k in names:
            state[k].copy_(sd[k])

    t = time.perf_counter()
    got = rlaunch.snapshot.load()
    r["load"] = time.perf_counter() - t
    assert got is not None, "nothing restored"
    t = time.perf_counter()
    assert got[0] == 9999 and "layer0.weight" in got[1], got[0]
    touch(got[1])
    r["load_touch"] = r["load"] + (time.perf_counter() - t)
    r["restored_step"] = got[0]

    def tl():
        r.setdefault("_sd", torch.load(path))

    t = time.perf_counter()
    sd = torch.load(path)
    r["torch_load"] = time.perf_counter() - t
    t = time.perf_counter()
    touch(sd)
    r["torch_load_touch"] = r["torch_load"] + (time.perf_counter() - t)
    os.unlink(path)
    json.dump(r, open(os.path.join(out, "attempt1.json"), "w"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target/debug/rlaunch"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    ap.add_argument("--out", default=os.path.join(HERE, "COST.md"))
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.mib, args.reps)
    out = tempfile.mkdtemp(prefix="rlaunch-bench-cost-")
    cmd = [args.rlaunch, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", "--snapshot-memory", "4096",
           args.python, os.path.abspath(__file__), "--child", out, "--mib", str(args.mib), "--reps", str(args.reps)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"the run failed:\n{p.stderr[-4000:]}")
    a = json.load(open(os.path.join(out, "attempt0.json")))
    b = json.load(open(os.path.join(out, "attempt1.json")))
    ms = lambda s: f"{s * 1000:.0f} ms"
    rows = [
        "| what | time | against |",
        "|---|---|---|",
        f"| one memcpy of the state (`copy_` into allocated tensors) | {ms(a['memcpy'])} | 1.0x |",
        f"| `rlaunch.snapshot.save` (steady: the buffer of the step it replaces is reused) | {ms(a['save'])} | {a['save'] / a['memcpy']:.2f}x memcpy |",
        f"| `rlaunch.snapshot.save`, the first (fresh memory) | {ms(a['save_first'])} | {a['save_first'] / a['memcpy']:.2f}x memcpy |",
        f"| `torch.save` to a tmpfs file | {ms(a['torch_save'])} | {a['torch_save'] / a['save']:.1f}x save |",
        f"| `dcp.async_save`, until it returns (training blocked) | {ms(a['dcp_async_blocking'])} | {a['dcp_async_blocking'] / a['save']:.1f}x save |",
        f"| `dcp.async_save`, until written | {ms(a['dcp_async_total'])} | {a['dcp_async_total'] / a['save']:.1f}x save |",
        f"| `rlaunch.snapshot.load` after a restart (mapped, copy-on-write) | {ms(b['load'])} | |",
        f"| `torch.load` of the tmpfs file | {ms(b['torch_load'])} | {b['torch_load'] / b['load']:.0f}x load |",
        f"| `load`, then every byte copied into the program's tensors | {ms(b['load_touch'])} | |",
        f"| `torch.load`, then every byte copied | {ms(b['torch_load_touch'])} | {b['torch_load_touch'] / b['load_touch']:.1f}x load + copy |",
        f"| a training step ({a['train_mib']:.0f} MiB of parameters and momentum) | {ms(a['train_step'])} | |",
        f"| a snapshot of that state alone (`save` of the model's and the optimizer's `state_dict`) | {ms(a['train_save'])} | |",
        f"| the same step and a snapshot of it | {ms(a['train_step_snapshot'])} | {a['train_step'] / a['train_step_snapshot'] * 100:.0f} % of the speed |",
    ]
    # The Rust runtime's client, the same way (examples/snapshot_cost.rs).
    rust = os.path.join(ROOT, "target/debug/examples/snapshot_cost")
    p = subprocess.run([args.rlaunch, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                        "--snapshot-memory", "4096", rust, out, str(args.mib)], capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"the Rust run failed:\n{p.stderr[-4000:]}")
    c = json.load(open(os.path.join(out, "rust0.json")))
    d = json.load(open(os.path.join(out, "rust1.json")))
    rows += [
        "| **Rust** (`rlaunch::snapshot`, `examples/snapshot_cost.rs`): one memcpy of the state | " + ms(c["memcpy"]) + " | 1.0x |",
        f"| Rust `save` (steady) | {ms(c['save'])} | {c['save'] / c['memcpy']:.2f}x memcpy |",
        f"| Rust `save`, the first (fresh memory) | {ms(c['save_first'])} | {c['save_first'] / c['memcpy']:.2f}x memcpy |",
        f"| Rust: the state written to a tmpfs file | {ms(c['file_write'])} | {c['file_write'] / c['save']:.1f}x save |",
        f"| Rust `load` after a restart | {ms(d['load'])} | |",
        f"| Rust: the tmpfs file read back | {ms(d['file_read'])} | {d['file_read'] / max(d['load'], 1e-6):.0f}x load |",
        f"| Rust `load`, then every byte copied into the program's vectors | {ms(d['load_copy'])} | |",
        f"| Rust: the file read, then copied | {ms(d['file_read_copy'])} | {d['file_read_copy'] / d['load_copy']:.1f}x load + copy |",
    ]
    table = "\n".join(rows)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(HEAD.format(date=time.strftime("%Y-%m-%d"), mib=args.mib, reps=args.reps) + table + "\n")


HEAD = """# What a snapshot costs: rlaunch.snapshot vs memcpy, torch.save, DCP async_save, torch.load

Date: {date}. Machine: 2 cores, 24 GiB, PyTorch 2.15 (CPU), rlaunch's debug build. Script:
`bench/snapshot/cost.py`, one rank under `rlaunch --standalone`, {mib} MiB of float32 state in 16
tensors, median of {reps} (training: of 9 steps of each kind, alternated). `save` returns once the agent holds the part (its process may die
then); on one node nothing is copied elsewhere, so this is the whole cost a step pays.

"""


if __name__ == "__main__":
    main()
