"""Lightning's checkpoints in the agents' memory: a ``Trainer`` saves every N steps into
``rlaunch.snapshot`` and resumes from it after a restart or a node loss (a spare or a replacement
taking its place).

    import rlaunch.lightning

    trainer = L.Trainer(..., callbacks=[rlaunch.lightning.Snapshots(every_n_steps=1)])
    trainer.fit(model, data, ckpt_path=rlaunch.lightning.ckpt_path())

``Snapshots`` saves through Lightning's own ``trainer.save_checkpoint`` (every callback's and the
module's ``on_save_checkpoint`` run; the checkpoint holds what a ``.ckpt`` file would: the
module's state, the optimizers and schedulers, the loops' progress, the callbacks' state), but
the strategy hands the checkpoint to this callback instead of a file: the ranks that Lightning
writes on (rank 0 with DDP or one device) keep the whole checkpoint as their part of the step,
the others a part that says so. A step is restored only when every rank's part of it is held
(the commit rule of ``rlaunch.snapshot``), on every rank from the same step.

``ckpt_path()`` answers the path that makes ``fit`` resume from the step this round restores, or
None (no step held, or outside rlaunch): the same ``ckpt_path`` Lightning resumes from, so its
own restore runs (module, optimizers, loops, callbacks). A rank reads its own part, or the part of
rank 0 when its own only says so or the saved world had no such rank (a larger world).

As with Lightning's own checkpoints, a resume in the middle of an epoch repeats no batch only
when the data loader is resumable (it has ``state_dict``/``load_state_dict``, as torchdata's
``StatefulDataLoader``); otherwise Lightning warns and that epoch's data starts again. Every rank
restores rank 0's loops and loader state (Lightning writes rank 0's checkpoint only): right for
loaders whose place is the same on every rank (a ``DistributedSampler``'s). In a world of another
size the module and the optimizers are restored, and the loader's place is rank 0's, counted for
the old world. The step is saved after the optimizer step, before a validation due at that step:
a resume from it does not run that validation again.

The strategies that write their checkpoints themselves (FSDP, DeepSpeed, model-parallel, XLA)
are refused at ``fit``: save those with ``torch.distributed.checkpoint`` into ``rlaunch.dcp``.

Loading builds no class the checkpoint names unless allowed (``rlaunch.snapshot.load``'s rule):
Lightning's ``AttributeDict`` (the module's ``hparams``) is; others are named in
``Snapshots(allow=[...])``.

Outside rlaunch ``Snapshots`` saves nothing and ``ckpt_path()`` answers None (said once).
"""

from lightning.fabric.utilities.data import AttributeDict
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO
from lightning.pytorch.strategies import Strategy

from . import snapshot
from .snapshot import SnapshotError

__all__ = ["Snapshots", "ckpt_path"]

_MARK = "rlaunch.lightning"
_SCHEME = "rlaunch-snapshot://step-"
# What ckpt_path() loaded, handed to the load that follows it in fit: (step, part).
_held = None
_ALLOW = (AttributeDict,)
# The classes allowed to the loads of this process: every Snapshots' and ckpt_path()'s allow.
_allowed = list(_ALLOW)


def _allow(more=()):
    _allowed.extend(a for a in more if a not in _allowed)
    return tuple(_allowed)


def _path(step):
    return f"{_SCHEME}{step}"


def _step_of(path):
    s = str(path)
    if s.startswith(_SCHEME) and s[len(_SCHEME) :].isdigit():
        return int(s[len(_SCHEME) :])
    return None


def ckpt_path(*, allow=()):
    """The ``ckpt_path`` for ``trainer.fit`` that resumes from the step this round restores, or
    None when there is none (the first round, or outside rlaunch). It loads with the classes
    every ``Snapshots`` made so far allows, and ``allow``."""
    global _held
    got = snapshot.load(allow=_allow(allow))
    if got is None:
        _held = None
        return None
    _held = got
    return _path(got[0])


class _SnapshotIO(CheckpointIO):
    """The strategy's ``CheckpointIO`` while ``Snapshots`` is attached: a path of ours goes to
    the agents' memory, any other to the ``CheckpointIO`` it replaced (``ModelCheckpoint``'s files
    are written as before)."""

    def __init__(self, inner, owner):
        super().__init__()
        self.inner = inner
        self.owner = owner

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        step = _step_of(path)
        if step is None:
            return self.inner.save_checkpoint(checkpoint, path, storage_options=storage_options)
        self.owner._hold(step, checkpoint)

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        step = _step_of(path)
        if step is None:
            return self.inner.load_checkpoint(path, map_location=map_location, weights_only=weights_only)
        return self.owner._restore(step)

    def remove_checkpoint(self, path):
        if _step_of(path) is None:
            self.inner.remove_checkpoint(path)

    def teardown(self):
        self.inner.teardown()


class Snapshots(Callback):
    """Saves the trainer's checkpoint into the agents' memory every ``every_n_steps`` optimizer
    steps (after the step, as ``ModelCheckpoint(every_n_train_steps=...)`` does), as step
    ``trainer.global_step``. ``allow``: classes the checkpoint may name beyond Lightning's
    ``AttributeDict`` (a module's ``hparams`` holding other objects), as for
    ``rlaunch.snapshot.load``. ``saved`` says whether this rank's part of the last step was held
    (False outside rlaunch, or when it did not fit in the node's snapshot memory)."""

    def __init__(self, every_n_steps=1, *, allow=()):
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"rlaunch.lightning.Snapshots: every_n_steps is a whole number >= 1, not {every_n_steps!r}")
        self.every_n_steps = every_n_steps
        _allow(allow)
        self.saved = False
        # As ModelCheckpoint: never step 0 (no optimizer step yet; with gradient accumulation,
        # a half-accumulated batch).
        self._last = 0
        self._held_here = False

    def setup(self, trainer, pl_module, stage):
        strategy = trainer.strategy
        if type(strategy).save_checkpoint is not Strategy.save_checkpoint:
            raise SnapshotError(
                f"rlaunch.lightning.Snapshots: the {type(strategy).__name__} writes its checkpoints itself, "
                "not through a CheckpointIO; save its sharded state with torch.distributed.checkpoint into "
                "rlaunch.dcp.Writer(step) instead"
            )
        if isinstance(strategy.checkpoint_io, _SnapshotIO):
            # Left by a fit that raised (no teardown): this callback owns it now.
            strategy.checkpoint_io.owner = self
        else:
            strategy.checkpoint_io = _SnapshotIO(strategy.checkpoint_io, self)

    def teardown(self, trainer, pl_module, stage):
        io = trainer.strategy.checkpoint_io
        if isinstance(io, _SnapshotIO) and io.owner is self:
            trainer.strategy.checkpoint_io = io.inner

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        step = trainer.global_step
        if step == self._last or step % self.every_n_steps != 0 or not snapshot.enabled():
            return
        self._last = step
        self._held_here = False
        # Every rank builds the checkpoint (Lightning's hooks, and collectives some of them
        # need); the strategy hands it to _hold on the ranks it writes on.
        trainer.save_checkpoint(_path(step), weights_only=False)
        if not self._held_here:
            self.saved = bool(snapshot.save(step, {_MARK: 1, "holder": False}))

    def _hold(self, step, checkpoint):
        self._held_here = True
        self.saved = bool(snapshot.save(step, {_MARK: 1, "holder": True, "checkpoint": checkpoint}))

    def _restore(self, step):
        global _held
        got, _held = _held, None
        if got is None or got[0] != step:
            got = snapshot.load(allow=_allow())
        if got is None:
            raise SnapshotError(f"rlaunch.lightning: no step is held for this round (ckpt_path asked for step {step})")
        held, part = got
        if held != step:
            raise SnapshotError(f"rlaunch.lightning: this round restores step {held}, not {step}")
        if not (isinstance(part, dict) and part.get("holder")):
            # This rank's part only says that it was not written here, or the saved world had no
            # such rank: rank 0's holds the whole checkpoint.
            got = snapshot.load(rank=0, allow=_allow())
            part = None if got is None else got[1]
        if not (isinstance(part, dict) and part.get(_MARK) == 1 and "checkpoint" in part):
            raise SnapshotError(f"rlaunch.lightning: step {step} was not saved by rlaunch.lightning.Snapshots")
        self._last = step
        return part["checkpoint"]
