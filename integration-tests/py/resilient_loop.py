"""A gloo job whose function runs again in the same process when the job re-forms
(`@rlaunch.resilient`), for the survivor tests.

    resilient_loop.py OUT

Once per process: imports, a tensor that stands for the model, a data loader with a persistent
worker process (each step takes a batch; each entry's record names its worker's pid). Each entry of the function: a
process group from the environment, a "start" line in OUT/events.log (the format of the loop
worker of integration_tests::netns, so its helpers read it), this entry's environment in
OUT/env.HOST.LOCAL_RANK.ENTRY.json, then steps (an all_reduce each, a snapshot each) until any
rank sees OUT/stop (agreed with an all_reduce, so every rank leaves at the same step). A worker
that finds OUT/crash_HOST removes it and exits 7 (OUT/crash_every_HOST holding N: after 3 steps
of every entry while the restart count is under N). OUT/saved.HOST holds the last step saved.
Each entry's record also holds the process's open descriptors, threads and resident memory.
OUT/stubborn_HOST: this host's worker sleeps 60 s in every step, in Python, with no collective.
"""

import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import rlaunch

OUT = sys.argv[1]
HOST = os.environ.get("RL_HOST", "local")
entries = 0
model = torch.zeros(4)
# A data loader made once per process, its worker process persistent: it must live through
# every recovery of the function.
loader = iter(torch.utils.data.DataLoader(torch.arange(10**6), batch_size=4, num_workers=1, persistent_workers=True))


def rss_kib():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))



@rlaunch.resilient
def train():
    global entries
    entries += 1
    e = os.environ
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    step = 0
    got = rlaunch.snapshot.load()
    if got is not None:
        step = got[0] + 1
        model.copy_(got[1]["model"])
    with open(os.path.join(OUT, f"env.{HOST}.{e['LOCAL_RANK']}.{entries}.json"), "w") as f:
        json.dump({"env": dict(e), "pid": os.getpid(), "entry": entries, "resumed_at_step": step,
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
        model.add_(next(loader).float().mean() * 0 + 1.0)
        if rlaunch.snapshot.save(step, {"model": model}):
            with open(os.path.join(OUT, f"saved.{HOST}"), "w") as f:
                f.write(str(step))
        step += 1
        time.sleep(0.05)
    dist.destroy_process_group()


train()
