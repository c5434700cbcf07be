"""Hosts PyTorch's own TCPStore server (the libuv backend, torch's default) for the store
benchmark: prints the port, serves until stdin closes."""
import sys
from datetime import timedelta

import torch.distributed as dist

store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=300))
print(store.port, flush=True)
sys.stdin.read()
