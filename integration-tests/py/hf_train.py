"""A Hugging Face Trainer job (DDP, gloo, CPU) that keeps its checkpoints in rlaunch's agents
with rlaunch.hf and resumes from them.

    hf_train.py OUT STEPS

Deterministic: the model, the data (the Trainer's own shuffled sampler, seeded; it skips the
batches of the epoch already trained when it resumes) and gloo's sums are the same in every run
of the same world. Writes, per rank, OUT/r{rank}.log lines in snapshot_train.py's form:
`resume step=S world=W digest=D restart=R host=H t=T` once rlaunch.hf.checkpoint() wrote step S
for the Trainer (the digest of the model it holds), `loss step=S value=V digest=D` per step, `saved step=S t=T` once the step's
part was held, `final digest=D`.

Steps are numbered as the snapshots are, by the trainer's global step after it (the first is
1). SNAP_EXIT_AT="rank:step" (first process of the rank only) exits 3 before computing that step.
SNAP_SLEEP (seconds per step, default 0.05) paces the run.
"""

import json
import os
import time
import warnings

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.utils import logging as hf_logging

import rlaunch.hf
from steplog import HOST, OUT, RANK, RESTART, SLEEP, STEPS, WORLD, Data, digest, fault, log, saved_world

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()


class Samples(Data):
    # The Trainer hands the model its batches as keyword arguments.
    def __getitem__(self, i):
        x, y = super().__getitem__(i)
        return {"x": x, "labels": y}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
        self.last = None

    def forward(self, x, labels):
        loss = torch.nn.functional.cross_entropy(self.net(x), labels)
        self.last = loss.item()
        return {"loss": loss}


class Log(TrainerCallback):
    def __init__(self, resuming):
        self.resuming = resuming

    def on_step_begin(self, args, state, control, **kw):
        if fault("SNAP_EXIT_AT", state.global_step + 1, self.resuming):
            os._exit(3)

    def on_step_end(self, args, state, control, model=None, **kw):
        # After rlaunch.hf.Snapshots saved the step (callbacks run in the order given).
        step = state.global_step
        log(f"loss step={step} value={model.last!r} digest={digest(model.parameters())}")
        if SNAP.saved:
            log(f"saved step={step} t={time.time()!r}")
        time.sleep(SLEEP)


torch.manual_seed(0)
model = Model()
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
args = TrainingArguments(
    output_dir=os.path.join(OUT, f"hf-{RANK}"),
    max_steps=STEPS,
    per_device_train_batch_size=32,
    lr_scheduler_type="constant",
    max_grad_norm=0.0,
    save_strategy="no",
    logging_strategy="no",
    report_to=[],
    use_cpu=True,
    ddp_backend="gloo",
    dataloader_drop_last=True,
    disable_tqdm=True,
    ddp_find_unused_parameters=False,
    seed=0,
)
SNAP = rlaunch.hf.Snapshots(every_n_steps=1)
resume = rlaunch.hf.checkpoint()
if resume is not None:
    # What the Trainer resumes from: the step, and the model's digest, of the directory written.
    t = time.time()
    with open(os.path.join(resume, "trainer_state.json")) as f:
        step = json.load(f)["global_step"]
    weights = torch.load(os.path.join(resume, "pytorch_model.bin"), weights_only=True).values()
    log(f"resume step={step} world={WORLD} saved_world={saved_world()} digest={digest(weights)} restart={RESTART} host={HOST} t={t!r}")
trainer = Trainer(model=model, args=args, train_dataset=Samples(), optimizers=(opt, None), callbacks=[SNAP, Log(resume is not None)])
trainer.train(resume_from_checkpoint=resume)
torch.distributed.barrier()
log(f"final digest={digest(model.parameters())}")
