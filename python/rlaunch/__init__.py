"""rlaunch's Python side: snapshots of each step's state held in the agents' memory.

    import rlaunch
    rlaunch.snapshot.save(step, {"model": model.state_dict(), "optim": opt.state_dict()})
    got = rlaunch.snapshot.load()      # (step, state) or None

Outside rlaunch both do nothing (and say so once), so one program runs both ways.
"""

from . import snapshot  # noqa: F401

__all__ = ["snapshot"]
