"""DDP training (gloo, CPU) that hands every step's state to rlaunch's agents and resumes from it.

    snapshot_train.py OUT STEPS

Deterministic: the model, the data of each step and rank, and gloo's sums are the same in every
run of the same world, so an interrupted run that resumes from a snapshot must compute exactly
the losses of an uninterrupted one. Writes, per rank, OUT/r{rank}.log lines:
`resume step=S world=W digest=D restart=R host=H t=T` after a load (T: when it returned, Unix
seconds), `loss step=S value=V digest=D` per step (V printed exactly, D of the model after the
step), `saved step=S t=T` once `save` returned True, and `final digest=D` at the end.

Faults (environment, first process of the rank only, i.e. TORCHELASTIC_RESTART_COUNT=0 and no
earlier resume): SNAP_EXIT_AT="rank:step" exits 3 before saving that step; SNAP_DIE_IN_SAVE=
"rank:step" dies (SIGKILL) in the middle of writing that step's snapshot. SNAP_SLEEP (seconds per
step, default 0.05) paces the run; SNAP_PAD_MB adds that many MiB of state per rank. SNAP_RESHARD=1: after a resume with a world other than the
saved one, every rank reads every saved rank's part with load(rank=k) and logs
`reshard parts=N steps=S`. SNAP_DCP=1: the state goes through torch.distributed.checkpoint
(dcp.save with rlaunch.dcp.Writer, dcp.load with rlaunch.dcp.Reader, the model's and optimizer's
state from torch.distributed.checkpoint.state_dict), the same lines logged; SNAP_DCP=async: with
dcp.async_save.
"""

import os
import signal
import time

import torch
import torch.distributed as dist

import rlaunch
from steplog import HOST, RANK, RESTART, SLEEP, STEPS, WORLD, fault, log
from steplog import digest as digest_of


def digest(model):
    return digest_of(model.parameters())


dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4))
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

# SNAP_PAD_MB: that many MiB more state per rank (the memory cap's test).
PAD = torch.zeros(int(float(os.environ.get("SNAP_PAD_MB", "0")) * (1 << 18)))
DCP = os.environ.get("SNAP_DCP") in ("1", "async")
if DCP:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import rlaunch.dcp

    def dcp_state():
        model_sd, optim_sd = get_state_dict(model, opt)
        return {"model": model_sd, "optim": optim_sd, "world": WORLD, "rank": RANK, "pad": PAD}

    def dcp_load():
        step = rlaunch.dcp.restored_step()
        if step is None:
            return None
        state = dcp_state()
        dcp.load(state, storage_reader=rlaunch.dcp.Reader())
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        return step, {"model": model.state_dict(), "optim": opt.state_dict(), "world": state["world"], "rank": state["rank"]}

start = 0
got = dcp_load() if DCP else rlaunch.snapshot.load()
loaded_at = time.time()
resumed = got is not None
if got is not None:
    step, state = got
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optim"])
    start = step + 1
    log(f"resume step={step} world={WORLD} saved_world={state['world']} digest={digest(model)} restart={RESTART} host={HOST} t={loaded_at!r}")
    if os.environ.get("SNAP_RESHARD") == "1" and state["world"] != WORLD:
        parts = [rlaunch.snapshot.load(rank=k) for k in range(state["world"])]
        steps = sorted({p[0] for p in parts})
        log(f"reshard parts={len(parts)} steps={','.join(map(str, steps))} ranks={','.join(str(p[1]['rank']) for p in parts)}")

for step in range(start, STEPS):
    if fault("SNAP_EXIT_AT", step, resumed):
        os._exit(3)
    g = torch.Generator().manual_seed(step * 1000 + RANK)
    x = torch.randn(32, 64, generator=g)
    y = torch.randint(0, 4, (32,), generator=g)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(ddp(x), y)
    loss.backward()
    opt.step()
    log(f"loss step={step} value={loss.item()!r} digest={digest(model)}")
    if fault("SNAP_DIE_IN_SAVE", step, resumed):
        import rlaunch.snapshot as snap
        real = snap._copy_into

        def die_after_the_first_array(*a):
            real(*a)
            os.kill(os.getpid(), signal.SIGKILL)

        snap._copy_into = die_after_the_first_array
    if DCP:
        writer = rlaunch.dcp.Writer(step)
        if os.environ["SNAP_DCP"] == "async":
            # Staged to the CPU, then written by a thread of DCP's; waited for here, so that the
            # step is held before the next one starts (a program may wait later).
            dcp.async_save(dcp_state(), storage_writer=writer).result()
        else:
            dcp.save(dcp_state(), storage_writer=writer)
        saved = writer.saved
    else:
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "world": WORLD, "rank": RANK, "pad": PAD}
        saved = rlaunch.snapshot.save(step, state)
    if saved:
        log(f"saved step={step} t={time.time()!r}")
    time.sleep(SLEEP)

dist.barrier()
log(f"final digest={digest(model)}")
