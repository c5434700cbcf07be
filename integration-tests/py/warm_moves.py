# A program that changes sys.path and its working directory as it is imported, imports a module
# of its own directory (which must run as the worker, never ahead in a warm interpreter) and an
# installed one that reads RANK as it is imported (rank_at_import, which the test puts in a
# site-packages folder on PYTHONPATH), and crashes rank 1 on the first attempt. Each rank
# writes what it saw to $PROBE_DIR.
import json
import os
import sys
import tempfile

import rank_at_import
import torch  # noqa: F401

# A worker that a warm interpreter became still has the bootstrap's command line.
WARM = b"rlaunch_warm.py" in open("/proc/self/cmdline", "rb").read()

here = os.path.dirname(os.path.abspath(__file__))
extra = tempfile.mkdtemp(prefix="warm-moves-")
with open(os.path.join(extra, "moved_helper.py"), "w") as f:
    f.write("import os\nRANK_AT_IMPORT = os.environ.get('RANK')\n")
sys.path.insert(0, extra)
os.chdir(extra)

import moved_helper  # noqa: E402
import warm_own_module  # noqa: E402

attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
rank = os.environ["RANK"]
with open(os.path.join(os.environ["PROBE_DIR"], f"rank{rank}.attempt{attempt}.json"), "w") as f:
    json.dump(
        {
            "warm": WARM,
            "pid": os.getpid(),
            "cwd": os.getcwd(),
            "extra": extra,
            "moved_helper_rank": moved_helper.RANK_AT_IMPORT,
            "own_module_rank": warm_own_module.RANK_AT_IMPORT,
            "own_module_file": warm_own_module.__file__,
            "installed_rank": rank_at_import.RANK,
        },
        f,
    )
if attempt == 0:
    import time

    # Long enough for the next warm set to be started and to finish its imports.
    time.sleep(float(os.environ.get("PROBE_HOLD", "8")))
    if rank == "1":
        os._exit(3)
    time.sleep(60)
