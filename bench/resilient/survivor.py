"""A node lost mid-training, the survivors' program under torch.compile: do the survivors keep
their processes (`@rlaunch.resilient`), against rlaunch's restart path and torchrun, in the same
run. Plot: step against time since the fault.

Hosts as network namespaces (the harness of bench/recovery/bench.py), etcd and
`rlaunch-rendezvous --store etcd` in the root namespace (torchrun: its c10d store on host a).
Hosts a and b run 2 ranks each of train.py (DDP, gloo, an MLP under torch.compile, a snapshot
every step); with a spare, host c waits. At step CUT host b's link is cut and every process of
it killed 0.3 s later. Rows:

  0  rlaunch, restart path: the survivor goes on alone (--nnodes 1:2), its processes started again
  1  rlaunch, @rlaunch.resilient: the survivor alone, its processes kept
  2  torchrun (c10d, --nnodes 1:2), disk checkpoint every 50 steps
  3  rlaunch, restart path, a spare waiting (--nnodes 2)
  4  rlaunch, @rlaunch.resilient, a spare waiting
  5-7  as 0-2, but the fault is one worker of host b killed (SIGKILL), no node lost
  8-9  as 5-6, the model not compiled
  10   as 4, each host with an inductor cache and a temporary directory of its own (hosts with
       local disks; here the hosts otherwise share /tmp and so one cache): the spare compiles cold
  11   as 10, the compiled code handed over with the snapshot (save/load with compiled=True)
  12   as 6, the compiled code handed over with the snapshot

Measured: the fault → the first training step again; the verdict (host a's agent hears the
round ended, its log) → that step; steps computed again; whether host a's ranks kept their
processes.

Usage (root): .venv/bin/python bench/resilient/survivor.py [--rows 0,1,2,3,4,5,6,7,8,9,10,11,12] [--out bench/resilient/RESULTS.md]
(the plot goes beside --out)
"""

import argparse
import datetime
import importlib.util
import os
import shutil
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
spec = importlib.util.spec_from_file_location("node_loss", os.path.join(ROOT, "bench/snapshot/node_loss.py"))
node_loss = importlib.util.module_from_spec(spec)
spec.loader.exec_module(node_loss)
# The hosts, etcd, the rendezvous, the launchers and the event log as bench/snapshot/node_loss.py
# has them.
recovery, start_services, events = node_loss.recovery, node_loss.start_services, node_loss.events
Net, wait_for = recovery.Net, recovery.wait_for
# (label, launcher, mode, a spare waiting, the fault: "cut" host b's link cut then its processes
# killed, "crash" one worker of host b killed and nothing else; torch.compile: "on", "off", or
# "own-cache", on with each host compiling into a cache of its own; "handover", own-cache with the
# compiled code saved and loaded with the snapshot; "handover-shared", the hand-over with the
# hosts' one shared cache)
ROWS = [
    ("rlaunch, restart path, survivor alone", "rlaunch", "plain", False, "cut", "on"),
    ("rlaunch, @rlaunch.resilient, survivor alone", "rlaunch", "resilient", False, "cut", "on"),
    ("torchrun (c10d), survivor alone, disk checkpoint every 50 steps", "torchrun", "disk", False, "cut", "on"),
    ("rlaunch, restart path, a spare waiting", "rlaunch", "plain", True, "cut", "on"),
    ("rlaunch, @rlaunch.resilient, a spare waiting", "rlaunch", "resilient", True, "cut", "on"),
    ("rlaunch, restart path, a worker of host b killed", "rlaunch", "plain", False, "crash", "on"),
    ("rlaunch, @rlaunch.resilient, a worker of host b killed", "rlaunch", "resilient", False, "crash", "on"),
    ("torchrun (c10d), a worker of host b killed, disk checkpoint every 50 steps", "torchrun", "disk", False, "crash",
     "on"),
    ("rlaunch, restart path, a worker of host b killed, no torch.compile", "rlaunch", "plain", False, "crash", "off"),
    ("rlaunch, @rlaunch.resilient, a worker of host b killed, no torch.compile", "rlaunch", "resilient", False,
     "crash", "off"),
    ("rlaunch, @rlaunch.resilient, a spare waiting, each host its own inductor cache", "rlaunch", "resilient", True,
     "cut", "own-cache"),
    ("rlaunch, @rlaunch.resilient, a spare waiting, each host its own inductor cache, the compiled code handed over",
     "rlaunch", "resilient", True, "cut", "handover"),
    ("rlaunch, @rlaunch.resilient, a worker of host b killed, the compiled code handed over", "rlaunch", "resilient",
     False, "crash", "handover-shared"),
]


def entries(out):
    """[(host, local_rank, pid, n, t)] from OUT/entries.log."""
    got = []
    try:
        lines = open(os.path.join(out, "entries.log")).read().splitlines()
    except OSError:
        return got
    for line in lines:
        kv = dict(p.split("=", 1) for p in line.split()[1:] if "=" in p)
        try:
            got.append((kv["host"], int(kv["local_rank"]), int(kv["pid"]), int(kv["n"]), float(kv["t"])))
        except (KeyError, ValueError):
            pass
    return got


def verdict_seen(out, t0):
    """When host a's agent heard that the round ended (its log's first such line after t0)."""
    try:
        lines = open(os.path.join(out, "agent-a.log"), errors="replace").read().splitlines()
    except OSError:
        return None
    for line in lines:
        if "re-forming" not in line and "declared this node lost" not in line:
            continue
        stamp = line.split()[0] if line.split() else ""
        try:
            t = datetime.datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        if t > t0:
            return t
    return None


def run(label, launcher, mode, spare, fault, compile_mode, args, net, root_ip):
    out = tempfile.mkdtemp(prefix="rlaunch-bench-survivor-")
    os.chmod(out, 0o777)
    a, b, c = net.hosts
    env = dict(os.environ, RLAUNCH_LOG="info", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0", LOGLEVEL="INFO",
               BENCH_COMPILE="0" if compile_mode == "off" else "1",
               BENCH_HANDOVER="1" if compile_mode.startswith("handover") else "0")
    script = [args.python, os.path.join(HERE, "train.py"), out, mode, str(args.steps)]
    cmd = node_loss.agent_command(args, launcher, script, "2" if spare else "1:2", f"bench-{mode}-{int(spare)}",
                                  root_ip, a)
    # "own-cache": each host compiles into a cache of its own, as hosts with local disks do (the
    # hosts here share /tmp, where inductor's cache is otherwise one for all), and keeps its
    # temporary files apart too (inductor's precompiled header is there, whatever its cache).
    def own(h):
        tmp = os.path.join(out, f"tmp-{h['name']}")
        os.makedirs(tmp, mode=0o700, exist_ok=True)
        return {"TORCHINDUCTOR_CACHE_DIR": os.path.join(out, f"inductor-{h['name']}"), "TMPDIR": tmp}

    if compile_mode not in ("own-cache", "handover"):
        own = None
    agents = node_loss.Agents(net, out, cmd, env, own)
    start = agents.start
    try:
        start(a)
        start(b)
        if not wait_for(lambda: any(e == "step" and s >= 10 for e, s, *_ in events(out)), 300):
            raise RuntimeError(f"{label}: no training (logs in {out})")
        if spare:
            start(c)
        if not wait_for(lambda: any(e == "step" and s >= args.cut for e, s, *_ in events(out)), 300):
            raise RuntimeError(f"{label}: never reached step {args.cut} (logs in {out})")
        t0 = time.time()
        if fault == "cut":
            net.cut_link(b)
            time.sleep(0.3)
            net.kill_all(b)
        else:
            victim = [pid for h, lr, pid, n, t in entries(out) if h == "b" and lr == 1][-1]
            os.kill(victim, 9)

        def again():
            evs = events(out)
            res = [(s, t) for e, s, t, *_ in evs if e in ("resume", "fresh") and t > t0]
            if not res:
                return None
            r_step, r_t = res[0]
            first = [t for e, s, t, *_ in evs if e == "step" and t > r_t]
            return (r_step, first[0]) if first else None

        got = wait_for(again, args.wait, step=0.1)
        evs = events(out)
        before = [s for e, s, t, *_ in evs if e == "step" and t <= t0 + 0.3]
        if got is None:
            return {"label": label, "again": None, "evs": evs, "t0": t0}
        r_step, t_first = got
        verdict = verdict_seen(out, t0) if launcher == "rlaunch" else None
        wait_for(lambda: any(e == "done" for e, *_ in events(out)), 300)
        evs = events(out)
        redone = [s for s in before if s > r_step]
        # The ranks that kept their processes: each entered the function again after the fault in
        # a process that had entered it before. The survivors: host a's ranks, and with one worker
        # killed host b's other one too.
        survivors = [("a", 0), ("a", 1)] + ([("b", 0)] if fault == "crash" else [])
        kept = sorted({(h, lr) for h, lr, pid, n, t in entries(out) if t > t0 and n >= 2})
        return {"label": label, "again": t_first - t0, "after_verdict": (t_first - verdict) if verdict else None,
                "redone": len(redone), "kept": kept, "survivors": survivors, "evs": evs, "t0": t0,
                "world": [w for e, s, t, l, w in evs if e == "step" and t >= t_first][:1]}
    finally:
        agents.stop()
        if args.keep:
            print(f"  logs kept in {out}", file=sys.stderr)
        else:
            shutil.rmtree(out, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cut", type=int, default=100)
    ap.add_argument("--wait", type=float, default=90.0)
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target/debug/rlaunch"))
    ap.add_argument("--rendezvous", default=os.path.join(ROOT, "target/debug/rlaunch-rendezvous"))
    ap.add_argument("--torchrun", default=os.path.join(ROOT, ".venv/bin/torchrun"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--rows", default="0,1,2,3,4,5,6,7,8,9,10,11,12")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the hosts are network namespaces")
    wanted = [int(x) for x in args.rows.split(",")]
    rows = []
    for i, (label, launcher, mode, spare, fault, compile_mode) in enumerate(ROWS):
        if i not in wanted:
            continue
        net = Net(3)
        data = tempfile.mkdtemp(prefix="rlaunch-bench-etcd-")
        side = []
        try:
            root_ip = start_services(net, args.rendezvous, data, side)
            r = None
            for attempt in range(2):
                try:
                    r = run(label, launcher, mode, spare, fault, compile_mode, args, net, root_ip)
                    break
                except RuntimeError as e:
                    print(f"{label}: {e}; again", flush=True)
            if r is None:
                r = {"label": label, "again": None, "evs": [], "t0": 0}
        finally:
            for p in side:
                p.kill()
                p.wait()
            net.close()
            shutil.rmtree(data, ignore_errors=True)
        rows.append(r)
        print(f"{label}: again after {r['again']}, after the verdict {r.get('after_verdict')}, "
              f"redone {r.get('redone')}, processes kept {r.get('kept')}, world {r.get('world')}", flush=True)

    sec = lambda v: f"{v:.2f} s" if v is not None else "–"
    table = ["| | fault → first training step again | verdict heard → that step | steps computed again | surviving ranks that kept their process | world after |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        again = sec(r["again"]) if r["again"] is not None else f"never (bounded wait {args.wait:.0f} s)"
        kept = "–"
        if "survivors" in r:
            kept_ = [s for s in r["survivors"] if s in r["kept"]]
            kept = f"{len(kept_)} of {len(r['survivors'])}" + (
                f" ({', '.join(f'{h}{lr}' for h, lr in kept_)})" if kept_ else "")
        table.append(f"| {r['label']} | {again} | {sec(r.get('after_verdict'))} | {r.get('redone', '–')} | {kept} | "
                     f"{(r.get('world') or ['–'])[0]} |")
    text = "\n".join(table)
    print(text)
    if args.out:
        there = os.path.dirname(os.path.abspath(args.out))
        os.makedirs(there, exist_ok=True)
        plot(rows, os.path.join(there, "survivor.png"), args.cut)
        with open(args.out, "w") as f:
            f.write(HEAD.format(date=time.strftime("%Y-%m-%d"), steps=args.steps, cut=args.cut) + text + "\n" + TAIL)


def plot(rows, path, cut):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        pts = [(t - r["t0"], s) for e, s, t, *_ in r["evs"] if e == "step"]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", markersize=2, label=r["label"])
    ax.axvline(0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since the fault (host b's link cut, or one of its workers killed)")
    ax.set_ylabel("step (rank 0)")
    ax.set_xlim(-5, 40)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(f"A fault at step {cut}, the model under torch.compile (but where a row says not)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


HEAD = """# Survivors that keep their process: a node lost, the program under torch.compile

Date: {date}. Machine: 2 cores, 24 GiB, PyTorch 2.15 (CPU, gloo), rlaunch's debug build. Script:
`bench/resilient/survivor.py` (as root), one run per row, the rows one after another.

Hosts as network namespaces; etcd and `rlaunch-rendezvous --store etcd` in the root namespace
(torchrun: its c10d store on host a). Hosts a and b run 2 ranks each of `train.py` (DDP, gloo,
an MLP under `torch.compile`, a snapshot every step, about 8 steps a second, {steps} steps);
in the spare rows host c waits. At step {cut}, host b's link is cut and 0.3 s later every
process of it is killed; in the rows of a worker killed, only host b's local rank 1 is killed
(SIGKILL), no node lost; two rows without `torch.compile`; in the rows of "each host its own
inductor cache", each host has an inductor cache and a `$TMPDIR` of its own (elsewhere the hosts
share `/tmp` and with it one warm cache); in the rows of "the compiled code handed over",
`train.py` saves and loads its snapshot with `compiled=True`. "Verdict heard": host a's
agent learns that the round ended (node TTL 2 s, heartbeats every 0.5 s). "Steps computed
again": steps logged before the fault computed again after the resume. "Kept": the surviving
ranks (host a's; with a worker killed, host b's other one too) that entered the training
function again in the process they had before the fault.

"""

TAIL = """
![step against time since the fault](survivor.png)
"""


if __name__ == "__main__":
    main()
