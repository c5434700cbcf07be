"""A Lightning job whose checkpoints live in rlaunch's agents (rlaunch.lightning): every step is
saved into the agents' memory, and a restarted, re-formed or resized job resumes from the last
one through Lightning's own restore.

    rlaunch --standalone --nproc-per-node 2 --max-restarts 3 examples/lightning_snapshots.py

Kill a worker while it trains (`pkill -f lightning_snapshots.py -n`): the agent restarts the
workers, and rank 0 prints `resumed at step N` with no step lost. Outside rlaunch (plain
`python examples/lightning_snapshots.py`) it trains on one process and saves nothing.

Against a script without rlaunch, the two marked lines are all that changed.
"""

import os
import time

import lightning as L
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

import rlaunch.lightning

STEPS = int(os.environ.get("STEPS", "200"))


class Data(torch.utils.data.Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(32, generator=g)
        return x, (x.sum() > 0).long()


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 2))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.cross_entropy(self.net(x), y)
        if self.global_rank == 0 and self.global_step % 20 == 0:
            print(f"step {self.global_step} loss {loss.item():.4f}", flush=True)
        time.sleep(0.02)
        return loss

    def on_load_checkpoint(self, checkpoint):
        if self.global_rank == 0:
            print(f"resumed at step {checkpoint['global_step']}", flush=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


world = int(os.environ.get("WORLD_SIZE", "1"))
local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
trainer = L.Trainer(
    accelerator="cpu",
    devices=local,
    num_nodes=world // local,
    strategy="ddp" if world > 1 else "auto",
    max_steps=STEPS,
    callbacks=[rlaunch.lightning.Snapshots(every_n_steps=1)],  # added: save each step in memory
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
)
# A resumable loader: a resume in the middle of an epoch repeats no batch.
loader = StatefulDataLoader(Data(), batch_size=64)
trainer.fit(Classifier(), loader, ckpt_path=rlaunch.lightning.ckpt_path())  # added: resume from it
