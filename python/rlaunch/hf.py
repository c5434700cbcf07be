"""The Hugging Face ``Trainer``'s checkpoints in the agents' memory: it saves every N steps into
``rlaunch.snapshot`` and resumes from it after a restart or a node loss (a spare or a replacement
taking its place).

    import rlaunch.hf

    trainer = Trainer(..., callbacks=[rlaunch.hf.Snapshots(every_n_steps=1)])
    trainer.train(resume_from_checkpoint=rlaunch.hf.checkpoint())

``Snapshots`` is a ``TrainerCallback``: after each N-th optimizer step (``on_step_end``, as the
Trainer's own ``save_steps``) every rank saves, as its part of step ``state.global_step``, what
the Trainer writes to a checkpoint directory: on the main process (rank 0, which alone writes the
model with DDP) the model's state, the optimizer's, the scheduler's, the fp16 grad scaler's and the
``TrainerState``; on every rank its random number generators' states. The step is saved before
the Trainer's own logging and evaluation of that step: the state holds neither that step's log
entry nor its evaluation's metrics. A step is restored only when every rank's part
of it is held (the commit rule of ``rlaunch.snapshot``).

``checkpoint()`` answers a checkpoint directory of the step this round restores, or None (no
step held, or outside rlaunch). The Trainer resumes from files only: the directory is written
from the agent's memory into the node's memory (``/dev/shm``, a directory per rank), in the
Trainer's own layout (``pytorch_model.bin``, ``optimizer.pt``, ``scheduler.pt``,
``trainer_state.json``, ``rng_state_<rank>.pth``), so the Trainer's own resume runs: it loads the
states and skips the batches of the epoch already trained (counted, as the Trainer counts them,
for the world it runs in: in a world of another size the model and the optimizer are restored,
and the place in the data is the Trainer's own guess). The directory is removed once the first
step after the resume begins (or the process exits; one whose process is gone, which no longer
holds its lock, is removed by the next ``checkpoint()`` on the node). If ``/dev/shm`` has no room
for it, it goes to the temporary directory. A rank the saved world did not have takes rank 0's
random states.

DeepSpeed, FSDP and tensor-parallel models (sharded parameters) are refused: save those with
``torch.distributed.checkpoint`` into ``rlaunch.dcp``.

Loading builds no class the saved state names unless allowed (``rlaunch.snapshot.load``'s rule):
the Trainer then reads the files with ``torch.load(weights_only=True)``: a class that either
must build is best allowed with ``torch.serialization.add_safe_globals([...])``, which both
honour (``checkpoint(allow=[...])`` allows it for rlaunch's load only).

Outside rlaunch ``Snapshots`` saves nothing and ``checkpoint()`` answers None (said once).
"""

import atexit
import dataclasses
import fcntl
import json
import os
import random
import shutil
import tempfile

import numpy as np
import torch
from transformers import TrainerCallback

from . import snapshot
from .snapshot import SnapshotError

__all__ = ["Snapshots", "checkpoint"]

_MARK = "rlaunch.hf"
_PREFIX = "rlaunch-hf-"
_LOCK = ".owner"
# The directories this process wrote, with the locked file that says so (removed by Snapshots
# once used, or at exit).
_written = {}


def _rank():
    return int(os.environ.get("RANK") or 0)


def _world():
    return int(os.environ.get("WORLD_SIZE") or 1)


def _rng_state(args):
    # The Trainer's own _save_rng_state, for CPUs and CUDA (as the Trainer loads it).
    from transformers.training_args import ParallelMode

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}
    if torch.cuda.is_available():
        if args.parallel_mode == ParallelMode.DISTRIBUTED:
            state["cuda"] = torch.cuda.random.get_rng_state_all()
        else:
            state["cuda"] = torch.cuda.random.get_rng_state()
    return state


def _nbytes(obj):
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(v) for v in obj)
    return 64


def _base(need):
    """/dev/shm when it is writable and has room for ``need`` bytes (a container's is often
    64 MiB), else the temporary directory."""
    shm = "/dev/shm"
    try:
        st = os.statvfs(shm)
        if os.access(shm, os.W_OK) and st.f_bavail * st.f_frsize > need * 1.1 + (64 << 20):
            return shm
    except OSError:
        pass
    return tempfile.gettempdir()


def _remove(path):
    shutil.rmtree(path, ignore_errors=True)
    lock = _written.pop(path, None)
    if lock is not None:
        lock.close()


def _remove_all():
    for path in list(_written):
        _remove(path)


atexit.register(_remove_all)


def _sweep(base):
    """Removes the directories that processes now gone left (a rank killed before it used its
    checkpoint keeps node memory otherwise): the lock a directory's owner holds is free (a
    process's locks go with it, whatever its PID namespace)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        if not name.startswith(_PREFIX) or path in _written:
            continue
        try:
            with open(os.path.join(path, _LOCK)) as f:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass  # held (in use), or not yet locked by a process making it


def checkpoint(*, allow=()):
    """A checkpoint directory of the step this round restores, for ``trainer.train(
    resume_from_checkpoint=...)``, or None when there is none (the first round, or outside
    rlaunch)."""
    got = snapshot.load(allow=allow)
    if got is None:
        return None
    step, own = got
    holder = own if isinstance(own, dict) and own.get("holder") else None
    if holder is None:
        # This rank did not write the model (DDP's ranks but the main one), or the saved world
        # had no such rank: rank 0's part holds the model, the optimizer and the state.
        held = snapshot.load(rank=0, allow=allow)
        holder = None if held is None else held[1]
    for part in (own, holder):
        if part is not None and not (isinstance(part, dict) and part.get(_MARK) == 1):
            raise SnapshotError(f"rlaunch.hf: step {step} was not saved by rlaunch.hf.Snapshots")
    if holder is None or not holder.get("holder"):
        raise SnapshotError(f"rlaunch.hf: no part of step {step} holds the model (rank 0's is not of rlaunch.hf)")
    rng = (own or holder)["rng"]
    base = _base(_nbytes(holder["model"]) + _nbytes(holder["optimizer"]))
    _sweep(base)
    path = tempfile.mkdtemp(prefix=f"{_PREFIX}{os.getpid()}-step{step}-", dir=base)
    lock = open(os.path.join(path, _LOCK), "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    _written[path] = lock
    try:
        torch.save(holder["model"], os.path.join(path, "pytorch_model.bin"))
        torch.save(holder["optimizer"], os.path.join(path, "optimizer.pt"))
        # (The Trainer reads the optimizer's file only beside a scheduler's.)
        torch.save(holder["scheduler"], os.path.join(path, "scheduler.pt"))
        if holder.get("scaler") is not None:
            torch.save(holder["scaler"], os.path.join(path, "scaler.pt"))
        with open(os.path.join(path, "trainer_state.json"), "w") as f:
            f.write(holder["trainer_state"])
        name = f"rng_state_{_rank()}.pth" if _world() > 1 else "rng_state.pth"
        torch.save(rng, os.path.join(path, name))
    except BaseException:
        _remove(path)
        raise
    return path


class Snapshots(TrainerCallback):
    """Saves the Trainer's state into the agents' memory every ``every_n_steps`` optimizer steps,
    as step ``state.global_step`` (see the module). ``saved``
    says whether this rank's part of the last step was held (False outside rlaunch, or when it
    did not fit in the node's snapshot memory)."""

    def __init__(self, every_n_steps=1):
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"rlaunch.hf.Snapshots: every_n_steps is a whole number >= 1, not {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        self.saved = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        sharded = getattr(args, "deepspeed", None) or getattr(args, "fsdp", None)
        sharded = sharded or getattr(args, "parallelism_config", None) or getattr(model, "tp_size", 1) not in (None, 1)
        if not sharded and model is not None:
            from torch.distributed.tensor import DTensor

            sharded = any(isinstance(p, DTensor) for p in model.parameters())
        if sharded:
            raise SnapshotError(
                "rlaunch.hf.Snapshots: DeepSpeed, FSDP and tensor-parallel models hold sharded states that rank 0 "
                "alone cannot save; save those with torch.distributed.checkpoint into rlaunch.dcp.Writer(step) instead"
            )

    def on_step_begin(self, args, state, control, **kwargs):
        # The Trainer has read the resumed directory (its random states last, just before this).
        _remove_all()

    def on_train_end(self, args, state, control, **kwargs):
        _remove_all()

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        step = state.global_step
        if step % self.every_n_steps != 0 or not snapshot.enabled():
            return
        part = {_MARK: 1, "holder": False, "rng": _rng_state(args)}
        if args.process_index == 0:
            scaler = getattr(optimizer, "scaler", None)
            part.update(
                holder=True,
                model=model.state_dict(),
                optimizer=optimizer.state_dict(),
                scheduler=lr_scheduler.state_dict(),
                scaler=None if scaler is None else scaler.state_dict(),
                trainer_state=json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n",
            )
        self.saved = bool(snapshot.save(step, part))
