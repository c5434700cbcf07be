"""rlaunch.lightning and rlaunch.hf outside rlaunch (RLAUNCH_SNAPSHOT unset), and what they refuse:
the resume paths are None, a Lightning fit trains and saves nothing (no file named after the
snapshot path either), the strategies that write their own checkpoints are refused naming
rlaunch.dcp, and every_n_steps is a whole number >= 1. Prints `fsdp refused`, `hf fsdp refused`
and `ok`."""

import types, lightning as L, torch
import rlaunch.lightning, rlaunch.hf
from lightning.pytorch.strategies import FSDPStrategy, DDPStrategy
from rlaunch.snapshot import SnapshotError
assert rlaunch.lightning.ckpt_path() is None
assert rlaunch.hf.checkpoint() is None
try:
    rlaunch.lightning.Snapshots().setup(types.SimpleNamespace(strategy=FSDPStrategy()), None, "fit")
except SnapshotError as e:
    assert "rlaunch.dcp" in str(e), e
    print("fsdp refused")
try:
    rlaunch.hf.Snapshots().on_train_begin(types.SimpleNamespace(deepspeed=None, fsdp=["full_shard"]), None, None)
except SnapshotError as e:
    print("hf fsdp refused")
for bad in (0, -1, 1.5, True, "2"):
    for cls in (rlaunch.lightning.Snapshots, rlaunch.hf.Snapshots):
        try:
            cls(every_n_steps=bad)
        except ValueError:
            continue
        raise SystemExit(f"{cls} took every_n_steps={bad!r}")
# A Lightning fit outside rlaunch: trains, saves nothing, writes no file named after the snapshot path.
class M(L.LightningModule):
    def __init__(s):
        super().__init__(); s.l = torch.nn.Linear(4, 1)
    def training_step(s, b, i):
        return s.l(b).sum()
    def configure_optimizers(s):
        return torch.optim.SGD(s.parameters(), lr=0.1)
snap = rlaunch.lightning.Snapshots()
t = L.Trainer(accelerator="cpu", devices=1, max_steps=3, callbacks=[snap], logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
t.fit(M(), torch.utils.data.DataLoader(torch.ones(6, 4), batch_size=2), ckpt_path=rlaunch.lightning.ckpt_path())
assert snap.saved is False and t.global_step == 3
import os
assert not any(n.startswith("rlaunch-snapshot") for n in os.listdir(".")), os.listdir(".")
print("ok")
