"""FSDP2 (CPU, gloo) training whose sharded state goes through torch.distributed.checkpoint into
rlaunch's agents (rlaunch.dcp) and, the same state, to DCP's own files on disk.

    dcp_fsdp.py OUT STEPS

Each step: the full model's and optimizer's digest (gathered), a DCP save to OUT/disk-STEP, then
one into the agents' memory (after the disk's, so that a step held in memory is whole on disk
too). Logs, per rank, OUT/r{rank}.log: `loss step=S value=V digest=D` per step, and after a
resume from memory `resume step=S world=W saved_world=SW mem=D1 disk=D2`: D1 the digest of the
state loaded from the agents (at this world size, resharded by DCP), D2 of the same step loaded
by DCP from its files into a fresh model. `final` at the end.
"""

import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import rlaunch.dcp

OUT, STEPS = sys.argv[1], int(sys.argv[2])
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (WORLD,))


def log(line):
    with open(os.path.join(OUT, f"r{RANK}.log"), "a") as f:
        f.write(line + "\n")


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    for m in model:
        if isinstance(m, torch.nn.Linear):
            fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.Adam(model.parameters(), lr=0.01)


def digest(model, opt):
    """The whole model's and optimizer's state, gathered from the shards (a collective)."""
    full = StateDictOptions(full_state_dict=True)
    h = hashlib.sha256()
    msd = get_model_state_dict(model, options=full)
    for k in sorted(msd):
        h.update(k.encode() + msd[k].detach().contiguous().numpy().tobytes())
    osd = get_optimizer_state_dict(model, opt, options=full)
    for fqn in sorted(osd["state"]):
        for k in sorted(osd["state"][fqn]):
            v = osd["state"][fqn][k]
            h.update(f"{fqn}.{k}".encode() + (v.detach().contiguous().numpy().tobytes() if torch.is_tensor(v) else repr(v).encode()))
    return h.hexdigest()[:16]


def state(model, opt):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "world": WORLD}


def load(model, opt, **where):
    st = state(model, opt)
    dcp.load(st, **where)
    set_state_dict(model, opt, model_state_dict=st["model"], optim_state_dict=st["optim"])
    return st["world"]


model, opt = build()
start = 0
step = rlaunch.dcp.restored_step()
if step is not None:
    saved_world = load(model, opt, storage_reader=rlaunch.dcp.Reader())
    mem = digest(model, opt)
    other, other_opt = build()
    load(other, other_opt, checkpoint_id=os.path.join(OUT, f"disk-{step}"))
    log(f"resume step={step} world={WORLD} saved_world={saved_world} mem={mem} disk={digest(other, other_opt)}")
    start = step + 1

for step in range(start, STEPS):
    g = torch.Generator().manual_seed(step * 1000 + RANK)
    x = torch.randn(16, 16, generator=g)
    y = torch.randint(0, 4, (16,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    d = digest(model, opt)
    st = state(model, opt)
    dcp.save(st, checkpoint_id=os.path.join(OUT, f"disk-{step}"))
    dcp.save(st, storage_writer=rlaunch.dcp.Writer(step))
    log(f"loss step={step} value={loss.item()!r} digest={d}")
    time.sleep(0.1)

dist.barrier()
log("final")
