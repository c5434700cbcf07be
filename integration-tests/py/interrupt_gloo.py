"""A gloo all_reduce waiting on a frozen peer (SIGSTOP: no reset, as after a link cut) is ended by
rlaunch.interrupt.interrupt_collectives from another thread; then, in the same process, the old
process group is destroyed and a new one (world size 1) reduces correctly.

Prints `ended_after=<s>` (from the interrupt to the collective raising), how many connections
were shut down, and `new_group_ok`."""

import datetime
import os
import signal
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from rlaunch.interrupt import interrupt_collectives

TIMEOUT = datetime.timedelta(seconds=60)


def peer(port):
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=TIMEOUT)
    t = torch.ones(4)
    dist.all_reduce(t)
    print("peer: reduced, freezing", flush=True)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(600)


def main():
    store = dist.TCPStore("127.0.0.1", 0, 2, True, timeout=TIMEOUT, wait_for_workers=False)
    port = store.port
    child = subprocess.Popen([sys.executable, __file__, "peer", str(port)])
    try:
        dist.init_process_group("gloo", store=store, rank=0, world_size=2, timeout=TIMEOUT)
        t = torch.ones(4)
        dist.all_reduce(t)
        assert t.tolist() == [2.0] * 4, t
        # Wait for the peer to freeze (it is stopped, not gone: its sockets stay open).
        deadline = time.time() + 30
        while time.time() < deadline:
            with open(f"/proc/{child.pid}/stat") as f:
                if f.read().split(")")[-1].split()[0] == "T":
                    break
            time.sleep(0.05)
        else:
            raise SystemExit("the peer never froze")

        fired = {}

        def interrupt():
            time.sleep(1.0)
            fired["at"] = time.monotonic()
            fired["count"] = interrupt_collectives(["127.0.0.1"], keep_ports=(port,))

        interrupter = threading.Thread(target=interrupt, daemon=True)
        interrupter.start()
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
            raise SystemExit("the all_reduce with a frozen peer returned")
        except RuntimeError as e:
            ended = time.monotonic()
            print(f"raised: {str(e).splitlines()[0][:200]}", flush=True)
        assert "at" in fired, f"raised before the interrupt, after {ended - started:.2f} s"
        # The collective raises at the first connection shut down, while the interrupt may still
        # be going through the others.
        interrupter.join(30)
        print(f"shut_down={fired['count']}", flush=True)
        print(f"ended_after={ended - fired['at']:.3f}", flush=True)
        dist.destroy_process_group()
    finally:
        child.kill()
        child.wait()
    # A new group in the same process, as a survivor makes for the next round.
    store2 = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=TIMEOUT)
    dist.init_process_group("gloo", store=store2, rank=0, world_size=1, timeout=TIMEOUT)
    t = torch.full((4,), 3.0)
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4, t
    dist.destroy_process_group()
    print("new_group_ok", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "peer":
        peer(int(sys.argv[2]))
    else:
        main()
