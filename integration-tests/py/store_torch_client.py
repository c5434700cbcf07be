"""Drives PyTorch's own TCPStore code against rlaunch's store (and hosts torch's server).

Modes:
  api HOST PORT   torch.distributed.TCPStore client: every query, with asserts.
  ddp             init_process_group("gloo", init_method="env://") with the agent store
                  (TORCHELASTIC_USE_AGENT_STORE=True, RANK/WORLD_SIZE/MASTER_* from the
                  environment), then an all_reduce and a barrier.
  full HOST PORT  a store capped at 1 MiB: a 2 MiB set raises in torch's client; another
                  client still reads the key set before it.
  serve           hosts torch's TCPStore server on an OS-chosen port, prints the port, and
                  serves until stdin closes (the reference server for our Rust client).
Exits non-zero with a traceback on any mismatch.
"""

import os
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def expect_timeout(fn, what):
    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # torch raises DistStoreError (a RuntimeError subclass)
        assert "timeout" in str(e).lower() or "timed out" in str(e).lower(), f"{what}: {e!r}"
        return time.monotonic() - start
    raise AssertionError(f"{what} did not time out")


def api(host, port):
    s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))

    # A key the Rust test set before starting us, through rlaunch's own client.
    assert s.get("from_rust") == b"hello from rust", s.get("from_rust")

    s.set("k", "v1")
    assert s.get("k") == b"v1"
    s.set("bin", bytes(range(256)))
    assert s.get("bin") == bytes(range(256))
    assert s.add("n", 5) == 5
    assert s.add("n", -2) == 3
    assert s.get("n") == b"3"

    assert s.compare_set("k", "v1", "v2") == b"v2"
    assert s.compare_set("k", "wrong", "v3") == b"v2"
    assert s.compare_set("fresh", "", "new") == b"new"
    assert s.compare_set("absent", "x", "y") == b"x"  # torch's quirk: echoes `expected`
    assert s.check(["k", "n"]) is True
    assert s.check(["k", "missing"]) is False

    s.wait(["k"])
    s.wait(["k", "n"], timedelta(seconds=1))
    took = expect_timeout(lambda: s.wait(["never"], timedelta(milliseconds=300)), "wait")
    assert 0.25 <= took < 5, took
    # The connection is still in step after cancel-wait.
    s.set("after_timeout", "ok")
    assert s.get("after_timeout") == b"ok"

    # A wait released by a set from another client (another connection).
    other = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
    released = []
    t = threading.Thread(target=lambda: (other.wait(["late"], timedelta(seconds=10)), released.append(1)))
    t.start()
    time.sleep(0.2)
    assert not released, "wait returned before the key existed"
    s.set("late", "now")
    t.join(timeout=10)
    assert released == [1], "wait was not released by the set"
    assert other.get("late") == b"now"

    n0 = s.num_keys()
    s.set("extra", "1")
    assert s.num_keys() == n0 + 1, (n0, s.num_keys())
    assert s.delete_key("extra") is True
    assert s.delete_key("extra") is False
    assert s.num_keys() == n0

    s.append("app", "a")
    s.append("app", "bc")
    assert s.get("app") == b"abc"

    s.multi_set(["m1", "m2"], ["one", "two"])
    assert s.multi_get(["m2", "m1", "k"]) == [b"two", b"one", b"v2"]

    if hasattr(s, "queue_push"):
        s.queue_push("q", "x")
        s.queue_push("q", "y")
        assert s.queue_len("q") == 2
        assert s.queue_pop("q") == b"x"
        assert s.queue_pop("q", block=False) == b"y"
        try:
            s.queue_pop("q", block=False)
        except dist.QueueEmptyError:
            pass
        else:
            raise AssertionError("pop of an empty queue succeeded")
        # (A blocking pop woken by another client's push is covered by the Rust tests: torch's
        # queue bindings hold the GIL while blocked, so a second thread here would deadlock.)
    if hasattr(s, "list_keys"):
        keys = s.list_keys()
        for k in ["k", "n", "app", "m1", "from_rust"]:
            assert k in keys, (k, keys)
    if hasattr(s, "barrier"):
        s.barrier("solo", 1, timedelta(seconds=5))
        expect_timeout(lambda: s.barrier("pair", 2, timedelta(milliseconds=300)), "barrier alone")
        s.set("after_barrier_timeout", "ok")
        assert s.get("after_barrier_timeout") == b"ok"

    # A store created with world_size adds to "init/" on connect, as workers do.
    dist.TCPStore(host, port, world_size=2, is_master=False, timeout=timedelta(seconds=20))

    s.set("from_py", "hello from python")
    print(f"STORE_API_OK torch={torch.__version__}", flush=True)


def ddp():
    assert os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert rank == int(os.environ["RANK"]) and world == int(os.environ["WORLD_SIZE"])
    t = torch.full((1024,), float(rank + 1))
    dist.all_reduce(t)
    expected = world * (world + 1) / 2
    assert torch.all(t == expected), (t[:4], expected)
    objs = [None] * world
    dist.all_gather_object(objs, {"rank": rank})
    assert [o["rank"] for o in objs] == list(range(world)), objs
    dist.barrier()
    dist.destroy_process_group()
    print(f"DDP_OK rank={rank} world={world} sum={t[0].item()}", flush=True)


def full(host, port):
    s = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
    s.set("keep", "kept")
    try:
        s.set("flood", b"x" * (2 << 20))
        s.get("flood")  # SET has no reply: the error shows on the next call
    except Exception as e:  # torch raises on the closed connection
        print(f"REFUSED {type(e).__name__}: {e}", flush=True)
    else:
        raise AssertionError("a write past the store's cap was taken")
    other = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=20))
    assert other.get("keep") == b"kept", other.get("keep")
    assert not other.check(["flood"])
    print("STORE_FULL_OK", flush=True)


def serve():
    s = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                      timeout=timedelta(seconds=30))
    print(s.port, flush=True)
    sys.stdin.read()  # until the parent closes our stdin


if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "api":
        api(sys.argv[2], int(sys.argv[3]))
    elif mode == "ddp":
        ddp()
    elif mode == "full":
        full(sys.argv[2], int(sys.argv[3]))
    elif mode == "serve":
        serve()
    else:
        raise SystemExit(f"unknown mode {mode}")
