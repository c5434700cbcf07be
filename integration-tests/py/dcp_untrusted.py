"""rlaunch.dcp's Reader and a saved object that names a function (one rank, no process group).

    dcp_untrusted.py OUT

First attempt: saves step 0 through DCP with an object whose unpickling would run a shell
command (touching OUT/ran), checks that a Writer serves one save only, and exits 3. Second
attempt: the step is restored; Reader refuses the object before anything of it runs
(rlaunch.snapshot.GlobalNotAllowed), and the file does not exist; prints `refused ran=False`.
"""

import os
import sys

import torch
import torch.distributed.checkpoint as dcp

import rlaunch.dcp
import rlaunch.snapshot

OUT = sys.argv[1]
MARK = os.path.join(OUT, "ran")


class Evil:
    def __reduce__(self):
        return (os.system, (f"touch {MARK}",))


if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
    w = rlaunch.dcp.Writer(0)
    dcp.save({"x": torch.arange(4.0), "obj": Evil()}, storage_writer=w)
    assert w.saved, "step 0 is held"
    try:
        dcp.save({"x": torch.arange(4.0)}, storage_writer=w)
    except BaseException as e:  # DCP may wrap it (CheckpointException)
        assert "one writer per save" in str(e), e
        print("reuse refused", flush=True)
    else:
        raise SystemExit("a writer served two saves")
    sys.stdout.flush()
    os._exit(3)

assert rlaunch.dcp.restored_step() == 0
state = {"x": torch.zeros(4), "obj": None}
try:
    dcp.load(state, storage_reader=rlaunch.dcp.Reader())
except BaseException as e:
    assert "refuses" in str(e) and "'obj'" in str(e), e
    print(f"refused ran={os.path.exists(MARK)}", flush=True)
else:
    raise SystemExit(f"loaded an object that runs code: ran={os.path.exists(MARK)}")
