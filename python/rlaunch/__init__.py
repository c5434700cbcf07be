"""rlaunch's Python side: snapshots of each step's state held in the agents' memory.

    import rlaunch
    rlaunch.snapshot.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    got = rlaunch.snapshot.load()      # (step, state) or None

Outside rlaunch both do nothing (and say so once), so one program runs both ways. ``load`` runs
no code from the saved bytes: tensors, numpy arrays, plain containers and scalars load as they
are; any other class only when named, ``load(allow=[MyClass])`` (see ``rlaunch.snapshot``).

``rlaunch.interrupt.interrupt_collectives(hosts)`` ends a gloo collective that waits on a peer
that will never answer (a frozen or cut-off host), from another thread of the same process: the
building block of survivors that keep their process across a re-formed round.

``rlaunch.dcp.Writer(step)`` and ``rlaunch.dcp.Reader()`` keep ``torch.distributed.checkpoint``'s
saves in the same memory (see ``rlaunch.dcp``); ``rlaunch.lightning.Snapshots`` and
``rlaunch.hf.Snapshots`` keep Lightning's and the Hugging Face Trainer's checkpoints there.

``@rlaunch.resilient`` marks the function that runs again, in the same process, when the job
re-forms (see ``rlaunch.resilient``'s module).
"""

from . import compiled, interrupt, snapshot  # noqa: F401
from .resilient import resilient  # noqa: F401

__all__ = ["compiled", "dcp", "hf", "interrupt", "lightning", "resilient", "snapshot"]


def __getattr__(name):
    # rlaunch.dcp imports torch.distributed.checkpoint, rlaunch.lightning Lightning and
    # rlaunch.hf transformers: only when asked for.
    if name in ("dcp", "hf", "lightning"):
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
