"""What a Lightning and a Hugging Face Trainer checkpoint cost through rlaunch (`rlaunch.lightning`,
`rlaunch.hf`), beside each trainer's own checkpoint files on a local disk and on tmpfs, and one
memcpy of the same state.

Run: .venv/bin/python bench/snapshot/trainers_cost.py [--reps 5] [--out bench/snapshot/TRAINERS.md]
Each trainer runs under `rlaunch --standalone --nproc-per-node 1 --max-restarts 1`: the first
attempt trains a step, then times its saves (rlaunch's callback's, and the trainer's own to files)
and exits 1; the restarted one times reading the step back into the module and the optimizer
(rlaunch: what the round restores; files: the trainer's own loaders).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from dcp_cost import SHM, timed  # noqa: E402  (the same timing as bench/snapshot/dcp_cost.py's)

# 8 layers of 2048 x 2048 float32 and SGD's momentum: 256 MiB of state.
LAYERS, WIDTH = 8, 2048


def net():
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(LAYERS)])


def memcpy_of(module, opt, reps):
    import torch

    src = [p.detach() for p in module.parameters()] + [s["momentum_buffer"] for s in opt.state.values()]
    dst = [torch.empty_like(t) for t in src]

    def copy(_):
        for d, s in zip(dst, src):
            d.copy_(s)

    copy(0)
    return timed(copy, reps)


def data():
    import torch

    x = torch.randn(8, WIDTH, generator=torch.Generator().manual_seed(0))
    return x, x.sum(1, keepdim=True)


def lightning_child(out, reps, disk):
    import lightning as L
    import torch

    import rlaunch.lightning

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net()

        def training_step(self, batch, i):
            x, y = batch
            return (self.net(x).sum(1, keepdim=True) - y).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)

    snap = rlaunch.lightning.Snapshots(every_n_steps=10**9)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    r = {}
    if attempt == 0:

        class Bench(L.Callback):
            def on_train_batch_end(self, trainer, module, *a):
                r["memcpy"] = memcpy_of(module, trainer.optimizers[0], reps)

                def rl(i):
                    trainer.save_checkpoint(rlaunch.lightning._path(1000 + i), weights_only=False)
                    assert snap.saved, "the agent holds the step"

                r["rlaunch_first"] = timed(rl, 1)
                r["rlaunch"] = timed(lambda i: rl(i + 1), reps)
                for name, base in (("disk", disk), ("tmpfs", SHM)):
                    r[name] = timed(
                        lambda i, base=base: trainer.save_checkpoint(os.path.join(base, f"lt-{i}.ckpt"), weights_only=False),
                        reps,
                    )
                with open(os.path.join(out, "lightning-save.json"), "w") as f:
                    json.dump(r, f)
                os._exit(1)

        trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, callbacks=[snap, Bench()], logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
        trainer.fit(M(), torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*data()), batch_size=8))
        return
    module = M()
    opt = module.configure_optimizers()

    def apply(ck):
        module.load_state_dict(ck["state_dict"])
        opt.load_state_dict(ck["optimizer_states"][0])

    path = rlaunch.lightning.ckpt_path()
    step = rlaunch.lightning._step_of(path)
    assert step == 1000 + reps, f"the last step saved is restored, not {step}"
    r["rlaunch_load"] = timed(lambda _: apply(snap._restore(step)), reps)
    for name, base in (("disk", disk), ("tmpfs", SHM)):
        f = os.path.join(base, f"lt-{reps - 1}.ckpt")
        r[f"{name}_load"] = timed(lambda _, f=f: apply(torch.load(f, weights_only=False)), reps)
    with open(os.path.join(out, "lightning-load.json"), "w") as f:
        json.dump(r, f)
    for i in range(reps):
        os.unlink(os.path.join(SHM, f"lt-{i}.ckpt"))


def hf_child(out, reps, disk):
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    import rlaunch.hf

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = net()

        def forward(self, x, labels):
            return {"loss": (self.net(x).sum(1, keepdim=True) - labels).pow(2).mean()}

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            x, y = data()
            return {"x": x[i], "labels": y[i]}

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    snap = rlaunch.hf.Snapshots(every_n_steps=1)  # (not a callback of the Trainer: called below)
    model = M()
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    args = TrainingArguments(output_dir=disk, max_steps=1, per_device_train_batch_size=8, save_strategy="no",
                             report_to=[], use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant")
    r = {}
    if attempt == 0:

        class Bench(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kw):
                r["memcpy"] = memcpy_of(model, opt, reps)
                step = state.global_step

                def rl(i):
                    state.global_step = 1000 + i
                    snap.on_step_end(args, state, control, model=model, optimizer=optimizer, lr_scheduler=lr_scheduler)
                    assert snap.saved, "the agent holds the step"

                r["rlaunch_first"] = timed(rl, 1)
                r["rlaunch"] = timed(lambda i: rl(i + 1), reps)
                for name, base in (("disk", disk), ("tmpfs", os.path.join(SHM, "rlaunch-hf-bench"))):
                    def own(i, base=base):
                        # The Trainer's own save at save_steps (model, optimizer, scheduler, RNG, state).
                        trainer.args.output_dir = os.path.join(base, str(i))
                        state.global_step = 1
                        trainer._save_checkpoint(trainer.model, trial=None)

                    r[name] = timed(own, reps)
                state.global_step = step
                with open(os.path.join(out, "hf-save.json"), "w") as f:
                    json.dump(r, f)
                os._exit(1)

        trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None), callbacks=[Bench()])
        trainer.train()
        return
    trainer = Trainer(model=model, args=args, train_dataset=Data(), optimizers=(opt, None))
    trainer.create_optimizer_and_scheduler(num_training_steps=1)
    # (Momentum buffers exist after a step: the loads fill them.)
    opt.state.clear()

    def read(directory):
        trainer._load_from_checkpoint(directory)
        trainer._load_optimizer_and_scheduler(directory)

    def rl(_):
        directory = rlaunch.hf.checkpoint()
        read(directory)
        shutil.rmtree(directory)

    r["rlaunch_load"] = timed(rl, reps)
    for name, base in (("disk", disk), ("tmpfs", os.path.join(SHM, "rlaunch-hf-bench"))):
        d = os.path.join(base, str(reps - 1), "checkpoint-1")
        r[f"{name}_load"] = timed(lambda _, d=d: read(d), reps)
    with open(os.path.join(out, "hf-load.json"), "w") as f:
        json.dump(r, f)
    shutil.rmtree(os.path.join(SHM, "rlaunch-hf-bench"), ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(HERE, "TRAINERS.md"))
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target", "release", "rlaunch"))
    ap.add_argument("--child", nargs=3, metavar=("TRAINER", "DIR", "DISK"))
    a = ap.parse_args()
    if a.child:
        which, out, disk = a.child
        return (lightning_child if which == "lightning" else hf_child)(out, a.reps, disk)
    results = {}
    for which in ("lightning", "hf"):
        work = tempfile.mkdtemp(prefix="rlaunch-trainers-bench-")
        # The trainers' files on the disk this repository is on (not tmpfs).
        disk = tempfile.mkdtemp(prefix="trainer-files-", dir=os.path.join(ROOT, "target"))
        try:
            cmd = [a.rlaunch, "--standalone", "--nproc-per-node", "1", "--max-restarts", "1", sys.executable,
                   os.path.abspath(__file__), "--reps", str(a.reps), "--child", which, work, disk]
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                sys.exit(f"the {which} benchmark failed:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}")
            results[which] = {
                **json.load(open(os.path.join(work, f"{which}-save.json"))),
                **json.load(open(os.path.join(work, f"{which}-load.json"))),
            }
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(disk, ignore_errors=True)
    import lightning
    import torch
    import transformers

    lines = [
        "# Lightning and the Hugging Face Trainer through rlaunch vs their own checkpoint files",
        "",
        f"Date: {time.strftime('%Y-%m-%d')}. Machine: {os.cpu_count()} cores, "
        f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB, PyTorch {torch.__version__} (CPU), "
        f"Lightning {lightning.__version__}, transformers {transformers.__version__}. Script: "
        f"`bench/snapshot/trainers_cost.py`, one rank under `rlaunch --standalone`, {LAYERS} layers of "
        f"{WIDTH}x{WIDTH} float32 and SGD's momentum (256 MiB of state), median of {a.reps} (the first save: one).",
        "",
        "Save: what blocks training (rlaunch: `Snapshots`' save of a step; files: Lightning's "
        "`trainer.save_checkpoint(path)`, the Trainer's own save at `save_steps`). Load: the step read back "
        "into the module and the optimizer (rlaunch: what the restarted round restores, with `rlaunch.hf` the "
        "checkpoint directory written to /dev/shm and read by the Trainer's own loaders; files: the same loaders).",
        "",
        "| trainer | what | rlaunch | disk | tmpfs | memcpy |",
        "|---|---|---|---|---|---|",
    ]
    for which, name in (("lightning", "Lightning"), ("hf", "HF Trainer")):
        r = results[which]
        ms = lambda k: f"{r[k] * 1e3:.0f} ms"  # noqa: E731
        x = lambda k, b: f"{r[k] / r[b]:.1f}x"  # noqa: E731
        lines.append(
            f"| {name} | save | {ms('rlaunch')} ({x('rlaunch', 'memcpy')} memcpy; first {ms('rlaunch_first')}) | "
            f"{ms('disk')} ({x('disk', 'rlaunch')}) | {ms('tmpfs')} ({x('tmpfs', 'rlaunch')}) | {ms('memcpy')} |"
        )
        lines.append(
            f"| {name} | load | {ms('rlaunch_load')} | {ms('disk_load')} ({x('disk_load', 'rlaunch_load')}) | "
            f"{ms('tmpfs_load')} ({x('tmpfs_load', 'rlaunch_load')}) | |"
        )
    lines += ["", "(In parentheses beside a file: its time over rlaunch's.)"]
    with open(a.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
