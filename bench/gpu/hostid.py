"""Runs a torchrun-style script with NCCL_HOSTID set for this rank, so that several ranks can
share the one GPU of a test machine in an NCCL group.

    rlaunch --standalone --nproc-per-node 2 bench/gpu/hostid.py bench/gpu/ddp_nccl.py --steps 300

NCCL refuses two ranks of a communicator on the same device ("Duplicate GPU detected") when it
takes them for ranks of one host. With a host identifier of its own, each rank looks like a
host of its own: NCCL connects them over its socket transport (loopback here), as it would two
nodes, and the script runs unmodified. For the GPU check only: it measures nothing about NVLink
or shared-memory transports.
"""

import os
import runpy
import sys

if len(sys.argv) < 2:
    sys.exit("usage: hostid.py SCRIPT [ARGS...]")
rank = os.environ.get("RANK", "0")
attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
os.environ["NCCL_HOSTID"] = f"gpu-check-rank{rank}-attempt{attempt}"
os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
os.environ.setdefault("NCCL_IB_DISABLE", "1")
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
runpy.run_path(sys.argv[0], run_name="__main__")
