"""`rlaunch.snapshot.load` runs no code from a part's bytes (three ranks, one node).

    snapshot_untrusted.py OUT

The first attempt saves step 0 and exits 3 (all three ranks once every one has saved); the agent
restarts the group, which loads it:
- rank 0 (PyTorch) saves a model's and an optimizer's state dicts, tensors, numpy arrays and
  scalars, nested containers, Python scalars, torch's Size, device and dtype, and a `Point` of
  its own: `load()` refuses the part (naming `__main__.Point`, whose `__setstate__` never
  runs), `load(allow=[Point])` and `load(allow=["__main__.Point"])` give it back equal;
- rank 1 has no torch (importing it fails): numpy and containers round-trip without it;
- rank 2 saves a hostile part, an object whose pickle calls `os.system("touch OUT/pwned")`:
  every rank's `load` of it refuses it, naming `posix.system`, and even `allow=[os.system]` is
  refused; OUT/pwned never appears.
Each rank then saves step 1 (the agent still serves) and prints `ok RANK`.
"""

import os
import sys
import time
from collections import Counter, OrderedDict

RANK = int(os.environ["RANK"])
OUT = sys.argv[1]
MARKER = os.path.join(OUT, "pwned")
if RANK != 0:
    sys.modules["torch"] = None  # `import torch` fails: the package must not need it

import numpy as np  # noqa: E402

import rlaunch  # noqa: E402
from rlaunch.snapshot import SnapshotError  # noqa: E402

BUILT = []


class Point:
    def __init__(self, x, y):
        self.x, self.y = x, y

    def __setstate__(self, state):
        BUILT.append(state)
        self.__dict__.update(state)

    def __eq__(self, other):
        return type(other) is Point and vars(self) == vars(other)


class Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {MARKER}",))


def state_of(rank):
    if rank == 0:
        import torch

        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        return {
            "model": model.state_dict(),
            "optim": opt.state_dict(),
            "rng": torch.get_rng_state(),
            "bf16": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3),
            "empty": torch.empty(0, 2),
            "zero_dim": torch.tensor(1.5),
            "np": np.arange(12, dtype=np.float32).reshape(3, 4),
            "np_scalars": [np.float64(0.5), np.int32(-3), np.bool_(True)],
            "nested": {"list": [1, [2, (3, {"four": 4.0})]], "set": {1, 2}, "frozen": frozenset({"a"}),
                       "od": OrderedDict(b=2, a=1), "counter": Counter("aab")},
            "scalars": (7, 2**70, -1.25, 3 - 4j, True, None, "text", b"bytes", bytearray(b"ba")),
            "torch": (torch.Size([2, 3]), torch.device("cpu"), torch.float16),
            "point": Point(1, [2, 3]),
        }
    if rank == 1:
        return {"np": np.linspace(0, 1, 7), "i8": np.arange(5, dtype=np.int8), "scalar": np.float32(0.25),
                "empty": np.zeros((0, 3)), "nested": [OrderedDict(a=np.ones(2)), {"k": (1, "x", None)}]}
    return {"w": np.zeros(3), "payload": Hostile()}


def same(a, b):
    if type(a) is not type(b):
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a == b
    return a == b


def refused(what, expect, **kwargs):
    try:
        got = rlaunch.snapshot.load(**kwargs)
    except SnapshotError as e:
        assert type(e).__name__ == "GlobalNotAllowed" and e.name == expect, f"{what}: {e}"
        assert expect in str(e) and "nothing of it was run" in str(e), str(e)
        print(f"rank {RANK}: {what} refused: {e}", flush=True)
        return
    raise AssertionError(f"{what}: loaded {got!r}, which needs {expect}")


if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    assert rlaunch.snapshot.save(0, state_of(RANK))
    open(os.path.join(OUT, f"saved{RANK}"), "w").close()
    deadline = time.time() + 60
    while not all(os.path.exists(os.path.join(OUT, f"saved{r}")) for r in range(3)):
        assert time.time() < deadline, "the other ranks never saved"
        time.sleep(0.05)
    sys.exit(3)

if RANK == 0:
    refused("this rank's part, with a class of its own", "__main__.Point")
    assert BUILT == [], "the refused class was never built"
    want = state_of(0)
    for allow in ([Point], ["__main__.Point"]):
        step, got = rlaunch.snapshot.load(allow=allow)
        assert step == 0 and same(got, want), f"allow={allow!r}: {got!r}"
    assert len(BUILT) == 2, BUILT
    step, got = rlaunch.snapshot.load(rank=1)
    assert step == 0 and same(got, state_of(1)), got
    try:
        rlaunch.snapshot.load(rank=2, allow=[os.system])
        raise AssertionError("os.system allowed")
    except ValueError as e:
        assert "never allowed" in str(e), e
elif RANK == 1:
    step, got = rlaunch.snapshot.load()
    assert step == 0 and same(got, state_of(1)), got
refused("rank 2's part", "posix.system", rank=2)
assert not os.path.exists(MARKER), "the hostile part ran"
assert rlaunch.snapshot.save(1, {"rank": RANK, "after": np.ones(4)})
print(f"ok {RANK}", flush=True)
