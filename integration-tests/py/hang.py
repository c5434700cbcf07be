# Unmodified torchrun-style script that hangs one rank; the others wait in a collective.
# The rank is 1, or the second argument.
#   hang.py sleep   rank 1 sleeps inside stuck_here() while the others wait in all_reduce
#   hang.py store   rank 1 waits forever on a store key nobody sets
#   hang.py raise   rank 1 raises while the others wait on a store key (a failure, not a hang;
#                   gloo peers of a dead rank fail at once, a store waiter does not)
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def stuck_here():
    time.sleep(3600)


def wait_for_key():
    dist.distributed_c10d._get_default_store().wait(["never-set"], timedelta(hours=1))


def main():
    dist.init_process_group("gloo", timeout=timedelta(hours=1))
    rank = dist.get_rank()
    t = torch.ones(4)
    dist.all_reduce(t)  # every rank got here
    print(f"rank {rank} ready", flush=True)
    if rank == (int(sys.argv[2]) if len(sys.argv) > 2 else 1):
        mode = sys.argv[1]
        if mode == "sleep":
            stuck_here()
        elif mode == "store":
            wait_for_key()
        else:
            raise RuntimeError("planted failure on rank 1")
    if sys.argv[1] == "raise":
        wait_for_key()
    dist.all_reduce(t)


main()
