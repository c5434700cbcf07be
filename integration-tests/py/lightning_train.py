"""A Lightning job (DDP, gloo, CPU) that keeps its checkpoints in rlaunch's agents with
rlaunch.lightning and resumes from them.

    lightning_train.py OUT STEPS

Deterministic: the model, the data (through torchdata's StatefulDataLoader, so that a resume in
the middle of an epoch repeats no batch; a DistributedSampler without shuffling, as Lightning
fast-forwards a resumed loader before it sets its sampler's epoch: a shuffled epoch after the
first would resume in the first epoch's order, with Lightning's own checkpoints too) and gloo's
sums are the same in every run of the same world. Writes, per rank, OUT/r{rank}.log lines in
snapshot_train.py's form: `resume step=S world=W digest=D restart=R host=H t=T` when Lightning
restored step S (the model's digest as restored), `loss step=S value=V digest=D` per step,
`saved step=S t=T` once the step's part was held, `final digest=D`.

Steps are numbered as the snapshots are, by the trainer's global step after it (the first is
1). SNAP_EXIT_AT="rank:step" (first process of the rank only) exits 3 before computing that step.
LT_HPARAMS=1: the module's hparams hold a class of this script's (Cfg), allowed by
Snapshots(allow=[Cfg]). SNAP_SLEEP (seconds per step, default 0.05) paces the run.
"""

import dataclasses
import os
import time
import warnings

import lightning as L
import torch
from lightning.pytorch.strategies import DDPStrategy
from torchdata.stateful_dataloader import StatefulDataLoader

import rlaunch.lightning
from steplog import HOST, LOCAL, RANK, RESTART, SLEEP, STEPS, WORLD, Data, digest, fault, log, saved_world

warnings.filterwarnings("ignore")
HPARAMS = os.environ.get("LT_HPARAMS") == "1"


@dataclasses.dataclass
class Cfg:
    # LT_HPARAMS=1: the module's hparams hold this class, which loading must be allowed to build.
    width: int = 256


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        if HPARAMS:
            self.save_hyperparameters({"cfg": Cfg()})
        self.net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
        self.resumed = False

    def training_step(self, batch, batch_idx):
        if fault("SNAP_EXIT_AT", self.trainer.global_step + 1, self.resumed):
            os._exit(3)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def on_load_checkpoint(self, checkpoint):
        # Called as Lightning restores: the state loaded is the checkpoint's.
        self.resumed = True
        step = checkpoint["global_step"]
        d = digest(checkpoint["state_dict"].values())
        log(f"resume step={step} world={WORLD} saved_world={saved_world()} digest={d} restart={RESTART} host={HOST} t={time.time()!r}")

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # After the step and after rlaunch.lightning.Snapshots saved it (callbacks run first).
        step = self.trainer.global_step
        log(f"loss step={step} value={outputs['loss'].item()!r} digest={digest(self.parameters())}")
        if SNAP.saved:
            log(f"saved step={step} t={time.time()!r}")
        time.sleep(SLEEP)


torch.manual_seed(0)
model = Model()
SNAP = rlaunch.lightning.Snapshots(every_n_steps=1, allow=[Cfg] if HPARAMS else [])
trainer = L.Trainer(
    accelerator="cpu",
    devices=LOCAL,
    num_nodes=WORLD // LOCAL,
    strategy=DDPStrategy(process_group_backend="gloo"),
    max_steps=STEPS,
    callbacks=[SNAP],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    use_distributed_sampler=False,
)
sampler = torch.utils.data.DistributedSampler(Data(), num_replicas=WORLD, rank=RANK, shuffle=False)
loader = StatefulDataLoader(Data(), batch_size=32, sampler=sampler)
trainer.fit(model, loader, ckpt_path=rlaunch.lightning.ckpt_path())
trainer.strategy.barrier()
log(f"final digest={digest(model.parameters())}")
