"""A gloo job whose function runs again in the same process when the job re-forms
(`@rlaunch.resilient`), for the survivor tests.

    resilient_loop.py OUT

Once per process: imports, a tensor that stands for the model, a data loader with a persistent
worker process (each step takes a batch; each entry's record names its worker's pid). Each entry of the function: a
process group from the environment, a "start" line in OUT/events.log (the format of the loop
worker of integration_tests::netns, so its helpers read it), this entry's environment in
OUT/env.HOST.LOCAL_RANK.ENTRY.json, then steps (an all_reduce each, a snapshot each) until any
rank sees OUT/stop (agreed with an all_reduce, so every rank leaves at the same step). A worker
that finds OUT/crash_HOST (or OUT/crash_HOST.LOCAL_RANK, for that local rank alone) removes it
and exits 7 (OUT/crash_every_HOST holding N: after 3 steps
of every entry while the restart count is under N). OUT/saved.HOST holds the last step saved.
OUT/crash_at_start_HOST holding N: this host's worker exits 7 as soon as the function is entered
while the restart count is under N (OUT/crash_at_start_HOST.LOCAL_RANK: that local rank alone). Each entry appends a line to OUT/entries.HOST.
Each entry's record also holds the process's open descriptors, threads and resident memory.
OUT/stubborn_HOST: this host's worker sleeps 60 s in every step, in Python, with no collective.

A step is a small DDP model's: the stop all_reduce, forward, backward (DDP's gradient
all_reduce), the optimizer step (which also adds 1 to the counter tensor, so that a state
restored at step s holds s), and the snapshot. OUT/hold_HOST naming a phase (forward, backward,
optimizer, save) holds this host's worker there once, from the fourth step of an entry on: it
removes the file, writes the step to OUT/held_HOST and waits (30 s at most) for the agent's word
that the round ended, then goes on with that phase. "save" holds inside rlaunch.snapshot.save,
while the state is being written.
"""

import collections
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import rlaunch
from rlaunch.resilient import saves_closed  # the module (rlaunch.resilient is the decorator)

OUT = sys.argv[1]
HOST = os.environ.get("RL_HOST", "local")
entries = 0
model = torch.zeros(4)  # the counter: a state restored at step s holds s
torch.manual_seed(0)
net = torch.nn.Linear(4, 1, bias=False)
# A data loader made once per process, its worker process persistent: it must live through
# every recovery of the function.
loader = iter(torch.utils.data.DataLoader(torch.arange(10**6), batch_size=4, num_workers=1, persistent_workers=True))


def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def hold(phase, step):
    """Holds here when OUT/hold_HOST names this phase (see the module)."""
    path = os.path.join(OUT, f"hold_{HOST}")
    try:
        with open(path) as f:
            if f.read().strip() != phase:
                return
    except OSError:
        return
    os.unlink(path)
    with open(os.path.join(OUT, f"held_{HOST}"), "w") as f:
        f.write(str(step))
    deadline = time.monotonic() + 30
    while not saves_closed() and time.monotonic() < deadline:
        time.sleep(0.01)


class HoldInSave:
    """Pickled inside rlaunch.snapshot.save: holds there (phase "save"), then stands for an
    empty OrderedDict, which load allows."""

    def __init__(self, step):
        self.step = step

    def __reduce__(self):
        hold("save", self.step)
        return (collections.OrderedDict, ())


@rlaunch.resilient
def train():
    global entries
    entries += 1
    e = os.environ
    with open(os.path.join(OUT, f"entries.{HOST}"), "a") as f:
        f.write(f"pid={os.getpid()} entry={entries} restart={e['TORCHELASTIC_RESTART_COUNT']}\n")
    try:
        at_start = os.path.join(OUT, f"crash_at_start_{HOST}")
        if not os.path.exists(at_start):
            at_start = os.path.join(OUT, f"crash_at_start_{HOST}.{e['LOCAL_RANK']}")
        with open(at_start) as f:
            if int(e["TORCHELASTIC_RESTART_COUNT"]) < int(f.read()):
                print(f"worker on {HOST} crashing at its start on purpose", file=sys.stderr, flush=True)
                os._exit(7)
    except (OSError, ValueError):
        pass
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    ddp = DDP(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    step = 0
    got = rlaunch.snapshot.load()
    if got is not None:
        step = got[0] + 1
        model.copy_(got[1]["model"])
        net.load_state_dict(got[1]["net"])
    with open(os.path.join(OUT, f"env.{HOST}.{e['LOCAL_RANK']}.{entries}.json"), "w") as f:
        json.dump({"env": dict(e), "pid": os.getpid(), "entry": entries, "resumed_at_step": step,
                   "counter": model[0].item(),
                   "loader_pids": [w.pid for w in loader._workers if w.is_alive()],
                   "fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
                   "rss_kib": rss_kib()}, f)
    with open(os.path.join(OUT, "events.log"), "a") as f:
        f.write(
            f"start t={time.time():.6f} host={HOST} local_rank={e['LOCAL_RANK']} rank={e['RANK']} "
            f"group_rank={e['GROUP_RANK']} world_size={e['WORLD_SIZE']} group_world_size={e['GROUP_WORLD_SIZE']} "
            f"restart={e['TORCHELASTIC_RESTART_COUNT']} master={e['MASTER_ADDR']}:{e['MASTER_PORT']} pid={os.getpid()}\n"
        )
    here = 0
    while True:
        crash = os.path.join(OUT, f"crash_{HOST}")
        if not os.path.exists(crash):
            crash = os.path.join(OUT, f"crash_{HOST}.{e['LOCAL_RANK']}")
        # OUT/crash_every_HOST holding N: this host's worker exits 7 after 3 steps of each entry
        # until the restart count reaches N.
        every = False
        try:
            with open(os.path.join(OUT, f"crash_every_{HOST}")) as f:
                every = here >= 3 and int(e["TORCHELASTIC_RESTART_COUNT"]) < int(f.read())
        except (OSError, ValueError):
            pass
        here += 1
        if os.path.exists(os.path.join(OUT, f"stubborn_{HOST}")):
            # Long work with no collective: the word that the round ended finds nothing to end.
            time.sleep(60)
        if every or os.path.exists(crash):
            if not every:
                os.unlink(crash)
            print(f"worker {e['RANK']} on {HOST} crashing on purpose", file=sys.stderr, flush=True)
            os._exit(7)
        stop = torch.tensor([1.0 if os.path.exists(os.path.join(OUT, "stop")) else 0.0])
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item() > 0:
            break
        if here > 3:
            hold("forward", step)
        batch = next(loader).float().reshape(1, 4)
        loss = ddp(batch / 1e6).sum()
        if here > 3:
            hold("backward", step)
        loss.backward()
        if here > 3:
            hold("optimizer", step)
        opt.step()
        opt.zero_grad()
        model.add_(1.0)
        state = {"model": model, "net": net.state_dict()}
        if here > 3:
            state["hold"] = HoldInSave(step)
        if rlaunch.snapshot.save(step, state):
            with open(os.path.join(OUT, f"saved.{HOST}"), "w") as f:
                f.write(str(step))
        step += 1
        time.sleep(0.05)
    dist.destroy_process_group()


train()
