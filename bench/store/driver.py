"""Store benchmark driver: torch's own TCPStore *client* against any TCPStore server.

usage: driver.py HOST PORT RUN_ID [--ops N] [--procs P]
Prints one JSON object: {metric: value}. Latencies in microseconds (per op, one client,
sequential; `set` has no reply in the protocol, so it is timed together with a `check` of the
same key; torch's `get` is a wait plus a get, two round trips); throughputs in ops/s (P client processes at once); "wake" is half the round trip
of a set→wait ping-pong between two processes (how fast a wait is released by another
client's set).
"""
import argparse
import json
import multiprocessing as mp
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def client(host, port):
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=120))


def lat(fn, n):
    for i in range(min(200, n)):  # warm-up
        fn(i)
    ts = []
    for i in range(n):
        t0 = time.perf_counter_ns()
        fn(i)
        ts.append(time.perf_counter_ns() - t0)
    ts.sort()
    return ts[n // 2] / 1e3, ts[min(n - 1, int(n * 0.99))] / 1e3


def ponger(host, port, prefix, n):
    s = client(host, port)
    s.set(f"{prefix}/ponger_ready", "1")
    for i in range(n):
        s.wait([f"{prefix}/ping/{i}"])
        s.set(f"{prefix}/pong/{i}", "1")


def tput_worker(host, port, prefix, op, n, rank, start, out):
    s = client(host, port)
    value = b"x" * 16
    s.set(f"{prefix}/{rank}/get", value)
    start.wait()
    t0 = time.perf_counter()
    if op == "set":
        for i in range(n):
            s.set(f"{prefix}/{rank}/{i}", value)
        s.num_keys()  # a round trip: every set before it has been applied
    elif op == "get":
        for i in range(n):
            s.get(f"{prefix}/{rank}/get")
    elif op == "add":
        for i in range(n):
            s.add(f"{prefix}/counter", 1)
    out.put(time.perf_counter() - t0)


def throughput(host, port, prefix, op, n, procs):
    ctx = mp.get_context("fork")
    start, out = ctx.Event(), ctx.Queue()
    ps = [ctx.Process(target=tput_worker, args=(host, port, f"{prefix}/{op}", op, n, r, start, out))
          for r in range(procs)]
    for p in ps:
        p.start()
    time.sleep(1.0)  # let every worker connect
    start.set()
    elapsed = max(out.get(timeout=300) for _ in ps)
    for p in ps:
        p.join(timeout=60)
    return procs * n / elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("host")
    ap.add_argument("port", type=int)
    ap.add_argument("run_id")
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--procs", type=int, default=4)
    a = ap.parse_args()
    p = f"bench/{a.run_id}"
    s = client(a.host, a.port)
    small = b"x" * 16
    big = b"y" * (1 << 20)
    r = {}
    # set has no reply: pair it with a check of the same key, so the time includes the server
    # applying it (one round trip), not just the client's send.
    def set_checked(i, value=small, key=None):
        key = key or f"{p}/k{i}"
        s.set(key, value)
        s.check([key])
    r["set_p50_us"], r["set_p99_us"] = lat(set_checked, a.ops)
    r["get_p50_us"], r["get_p99_us"] = lat(lambda i: s.get(f"{p}/k{i}"), a.ops)
    r["add_p50_us"], r["add_p99_us"] = lat(lambda i: s.add(f"{p}/ctr", 1), a.ops)
    r["wait_present_p50_us"], r["wait_present_p99_us"] = lat(lambda i: s.wait([f"{p}/k{i}"]), a.ops)
    r["check_p50_us"], r["check_p99_us"] = lat(lambda i: s.check([f"{p}/k{i}"]), a.ops)
    nbig = max(20, a.ops // 30)
    r["set_1MiB_p50_us"], _ = lat(lambda i: set_checked(i, big, f"{p}/big"), nbig)
    r["get_1MiB_p50_us"], _ = lat(lambda i: s.get(f"{p}/big"), nbig)

    # Wake latency: set -> another process's wait returns -> its set -> our wait returns.
    npp = max(200, a.ops // 3)
    ctx = mp.get_context("fork")
    pp = ctx.Process(target=ponger, args=(a.host, a.port, f"{p}/pp", npp + 200))
    pp.start()
    s.wait([f"{p}/pp/ponger_ready"])
    def ping(i):
        s.set(f"{p}/pp/ping/{i}", "1")
        s.wait([f"{p}/pp/pong/{i}"])
    # lat() warms up with indices 0..199, then measures 0..npp-1 again: shift the measured ones.
    warm = [0]
    def ping_unique(i):
        ping(warm[0])
        warm[0] += 1
    p50, p99 = lat(ping_unique, npp)
    pp.join(timeout=60)
    r["wake_p50_us"], r["wake_p99_us"] = p50 / 2, p99 / 2

    for op in ["set", "get", "add"]:
        r[f"{op}_tput_{a.procs}procs_ops_s"] = throughput(a.host, a.port, p, op, a.ops, a.procs)
    r["torch"] = torch.__version__
    print(json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
