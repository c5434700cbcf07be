"""A Hugging Face Trainer job whose checkpoints live in rlaunch's agents (rlaunch.hf): every step
is saved into the agents' memory, and a restarted, re-formed or resized job resumes from the last
one through the Trainer's own resume.

    rlaunch --standalone --nproc-per-node 2 --max-restarts 3 examples/hf_snapshots.py

Kill a worker while it trains (`pkill -f hf_snapshots.py -n`): the agent restarts the workers,
and rank 0 prints `resumed at step N` with no step lost. Outside rlaunch (plain
`python examples/hf_snapshots.py`) it trains on one process and saves nothing.

Against a script without rlaunch, the two marked lines are all that changed.
"""

import os
import tempfile
import time

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

import rlaunch.hf

STEPS = int(os.environ.get("STEPS", "200"))


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return {"x": x, "labels": (x.sum() > 0).long()}


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))

    def forward(self, x, labels):
        return {"loss": torch.nn.functional.cross_entropy(self.net(x), labels)}


class Progress(TrainerCallback):
    def on_train_begin(self, args, state, control, **kw):
        if args.process_index == 0 and state.global_step:
            print(f"resumed at step {state.global_step}", flush=True)

    def on_step_end(self, args, state, control, **kw):
        if args.process_index == 0 and state.global_step % 20 == 0:
            print(f"step {state.global_step}", flush=True)
        time.sleep(0.02)


args = TrainingArguments(
    output_dir=tempfile.mkdtemp(prefix="hf-snapshots-"),
    max_steps=STEPS,
    per_device_train_batch_size=64,
    save_strategy="no",
    report_to=[],
    use_cpu=True,
    ddp_backend="gloo",
    disable_tqdm=True,
)
trainer = Trainer(
    model=Classifier(),
    args=args,
    train_dataset=Data(),
    callbacks=[rlaunch.hf.Snapshots(every_n_steps=1), Progress()],  # added: save each step in memory
)
trainer.train(resume_from_checkpoint=rlaunch.hf.checkpoint())  # added: resume from it
