"""Store benchmark driver: torch's own TCPStore *client* against two TCPStore servers at once.

usage: driver.py HOST PORT_A PORT_B RUN_ID [--ops N] [--procs P] [--rounds R]

Both servers are measured in the same process, in small alternating batches (A,B,B,A,...), so
load from anything else on the machine hits both alike. Prints one JSON object
{"a": {metric: value}, "b": {...}}. Latencies are in microseconds per op from one client,
sequential: `set` has no reply in the protocol, so it is timed together with a `check` of the
same key (one round trip); torch's `get` is a wait plus a get (two round trips); `wake` is half
a set→wait ping-pong between two processes (how fast a wait is released by another client's
set). Throughputs are ops/s of P client processes at once, median of R alternating rounds.
"""
import argparse
import json
import multiprocessing as mp
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist

BATCH = 100


def client(host, port):
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=120))


def pct(ts, q):
    ts = sorted(ts)
    return ts[min(len(ts) - 1, int(len(ts) * q))] / 1e3


def interleaved(fns, n, batch=BATCH):
    """fns: {name: fn(i)}. Runs n ops on each, alternating batches; returns {name: [ns, ...]}."""
    names = list(fns)
    for name in names:  # warm-up
        for i in range(min(100, n)):
            fns[name](i)
    samples = {name: [] for name in names}
    i = 0
    flip = False
    while i < n:
        count = min(batch, n - i)
        for name in (reversed(names) if flip else names):
            fn, out = fns[name], samples[name]
            for j in range(i, i + count):
                t0 = time.perf_counter_ns()
                fn(j)
                out.append(time.perf_counter_ns() - t0)
        flip = not flip
        i += count
    return samples


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
    ps = [ctx.Process(target=tput_worker, args=(host, port, prefix, op, n, r, start, out))
          for r in range(procs)]
    for p in ps:
        p.start()
    time.sleep(0.5)  # let every worker connect
    start.set()
    elapsed = max(out.get(timeout=300) for _ in ps)
    for p in ps:
        p.join(timeout=60)
    return procs * n / elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("host")
    ap.add_argument("port_a", type=int)
    ap.add_argument("port_b", type=int)
    ap.add_argument("run_id")
    ap.add_argument("--ops", type=int, default=3000)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    host, p = a.host, f"bench/{a.run_id}"
    ports = {"a": a.port_a, "b": a.port_b}
    stores = {name: client(host, port) for name, port in ports.items()}
    small, big = b"x" * 16, b"y" * (1 << 20)
    res = {name: {} for name in ports}

    def record(metric, samples, p99=True):
        for name, ts in samples.items():
            res[name][f"{metric}_p50_us"] = pct(ts, 0.5)
            if p99:
                res[name][f"{metric}_p99_us"] = pct(ts, 0.99)

    def each(make):
        return {name: make(s) for name, s in stores.items()}

    def set_checked(s, value, key_of):
        def fn(i):
            s.set(key_of(i), value)
            s.check([key_of(i)])
        return fn

    record("set", interleaved(each(lambda s: set_checked(s, small, lambda i: f"{p}/k{i}")), a.ops))
    record("get", interleaved(each(lambda s: lambda i: s.get(f"{p}/k{i}")), a.ops))
    record("add", interleaved(each(lambda s: lambda i: s.add(f"{p}/ctr", 1)), a.ops))
    record("wait_present", interleaved(each(lambda s: lambda i: s.wait([f"{p}/k{i}"])), a.ops))
    record("check", interleaved(each(lambda s: lambda i: s.check([f"{p}/k{i}"])), a.ops))
    nbig = max(20, a.ops // 30)
    record("set_1MiB", interleaved(each(lambda s: set_checked(s, big, lambda i: f"{p}/big")), nbig, 10), p99=False)
    record("get_1MiB", interleaved(each(lambda s: lambda i: s.get(f"{p}/big")), nbig, 10), p99=False)

    # Wake latency: our set releases the ponger's wait; its set releases ours.
    npp = max(200, a.ops // 3)
    ctx = mp.get_context("fork")
    warmup = min(100, npp)  # interleaved() warms up with this many pings first
    pongers = [ctx.Process(target=ponger, args=(host, port, f"{p}/pp", npp + warmup))
               for port in ports.values()]
    for pp in pongers:
        pp.start()
    for s in stores.values():
        s.wait([f"{p}/pp/ponger_ready"])

    def pinger(s):
        seq = [0]  # each ping needs a fresh index, warm-up included
        def fn(_):
            i = seq[0]
            seq[0] += 1
            s.set(f"{p}/pp/ping/{i}", "1")
            s.wait([f"{p}/pp/pong/{i}"])
        return fn
    wake = interleaved(each(pinger), npp, 50)
    record("wake", {name: [t / 2 for t in ts] for name, ts in wake.items()})
    for pp in pongers:
        pp.join(timeout=60)

    for op in ["set", "get", "add"]:
        runs = {name: [] for name in ports}
        for r in range(a.rounds):
            for name in (list(ports) if r % 2 == 0 else list(reversed(list(ports)))):
                runs[name].append(throughput(host, ports[name], f"{p}/{op}/{r}", op, a.ops, a.procs))
        for name, v in runs.items():
            res[name][f"{op}_tput_{a.procs}procs_ops_s"] = statistics.median(v)
    for name in res:
        res[name]["torch"] = torch.__version__
    print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
