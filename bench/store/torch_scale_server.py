"""Hosts PyTorch's own TCPStore server (libuv backend) for the store scale benchmark
(examples/store_scale.rs).

usage: torch_scale_server.py [TIMEOUT_S] [ipv4|dual]

Prints one line "PORT TORCH_VERSION", then serves until stdin closes. The benchmark reads this
process's VmRSS/VmHWM, so it does nothing else: the server runs on torch's background thread.

Listener: `dual` is torch's own choice for `TCPStore("127.0.0.1", 0, is_master=True)`: it binds
"::" (IPv6, dual-stack), so a client at 127.0.0.1 arrives as ::ffff:127.0.0.1. `ipv4` (default)
binds 127.0.0.1 here and hands the socket to torch (`master_listen_fd`), as our server binds.
This matters because torch's server formats each new client's address with a reverse lookup
(getnameinfo) on its only event-loop thread: 127.0.0.1 is answered from /etc/hosts, while
::ffff:127.0.0.1 goes to DNS, and a slow or rate-limited resolver then stalls every client.
"""
import resource
import socket
import sys
from datetime import timedelta

# Thousands of workers connect at once: the soft descriptor limit (often 1024) would make the
# server refuse them, so raise it to the hard limit as the benchmark's other processes do.
# RLIM_INFINITY is not a valid soft limit for descriptors; fs.nr_open is the kernel's ceiling.
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
if hard == resource.RLIM_INFINITY:
    with open("/proc/sys/fs/nr_open") as f:
        hard = int(f.read())
if soft < hard:
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))

import torch  # noqa: E402  (after the limit: importing torch is slow, the limit is not)
import torch.distributed as dist  # noqa: E402

timeout = timedelta(seconds=float(sys.argv[1]) if len(sys.argv) > 1 else 300.0)
listen = sys.argv[2] if len(sys.argv) > 2 else "ipv4"
if listen == "dual":
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                          timeout=timeout)
elif listen == "ipv4":
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    # torch calls listen() itself, with its own backlog (the kernel's maximum).
    store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], is_master=True, use_libuv=True,
                          wait_for_workers=False, timeout=timeout, master_listen_fd=sock.fileno())
else:
    sys.exit(f"listener {listen!r}: use ipv4 or dual")
print(store.port, torch.__version__, flush=True)
sys.stdin.read()
