"""What the snapshot test jobs share (snapshot_train.py, lightning_train.py, hf_train.py): their
arguments and environment, the per-rank log whose lines the Rust tests read, the model's digest,
the fault each injects, the data of the trainer jobs, and the world a restored step was saved by.

    script.py OUT STEPS
"""

import hashlib
import os
import sys

import torch

OUT, STEPS = sys.argv[1], int(sys.argv[2])
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])
LOCAL = int(os.environ["LOCAL_WORLD_SIZE"])
RESTART = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
HOST = os.environ.get("RL_HOST", os.uname().nodename)
SLEEP = float(os.environ.get("SNAP_SLEEP", "0.05"))


def log(line):
    with open(os.path.join(OUT, f"r{RANK}.log"), "a") as f:
        f.write(line + "\n")


def digest(tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def fault(name, step, resumed):
    """Whether the fault ``name`` ("rank:step" in the environment) is due at ``step`` on this
    rank: only in the rank's first process (no restart, no earlier resume)."""
    spec = os.environ.get(name)
    if not spec or RESTART != 0 or resumed:
        return False
    rank, at = (int(x) for x in spec.split(":"))
    return rank == RANK and at == step


def saved_world():
    """How many ranks saved the step this round restores: the first rank whose part
    rlaunch.snapshot answers as absent (the parts of ranks past 0 are small in these jobs)."""
    import rlaunch.snapshot

    k = 1
    while (got := rlaunch.snapshot.load(rank=k)) is not None and got[1] is not None:
        k += 1
    return k


class Data(torch.utils.data.Dataset):
    """The trainer jobs' samples: 10 steps of 32 per rank and epoch at world 4 (the resumes fall
    inside epochs), each sample a function of its index."""

    def __len__(self):
        return 1280

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return torch.randn(64, generator=g), torch.randint(0, 4, (), generator=g)
