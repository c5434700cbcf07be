"""A node lost mid-training, with snapshots in the agents' memory, with disk checkpoints, and
under torchrun: steps computed again, time from the fault to training again, and whether the
steps computed again give the same losses. Plot: step against time since the fault.

Three hosts (network namespaces, the harness of bench/recovery/bench.py), etcd and
`rlaunch-rendezvous --store etcd` in the root namespace (torchrun: its c10d store on host a).
Hosts a and b run 2 ranks each of train_ddp.py (`--nnodes 2`); host c waits as a spare. At step
CUT (default 133), host b's link is cut and every process of it killed 0.3 s later.

Usage (root): .venv/bin/python bench/snapshot/node_loss.py [--steps 200] [--cut 133] [--wait 60]
"""

import argparse
import importlib.util
import json
import os
import urllib.request
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
spec = importlib.util.spec_from_file_location("recovery", os.path.join(ROOT, "bench/recovery/bench.py"))
recovery = importlib.util.module_from_spec(spec)
spec.loader.exec_module(recovery)
Net, wait_for, listening = recovery.Net, recovery.wait_for, recovery.listening
RDZV_PORT, ETCD_PORT, ETCD_PEER, C10D_PORT = 29431, 23790, 23800, 29400


def events(out):
    evs = []
    try:
        lines = open(os.path.join(out, "events.log")).read().splitlines()
    except OSError:
        return evs
    for line in lines:
        parts = line.split()
        if len(parts) < 2:
            continue
        kv = dict(p.split("=", 1) for p in parts[2:] if "=" in p)
        try:
            evs.append((parts[0], int(parts[1]), float(kv["t"]), kv.get("loss"), kv.get("world")))
        except (KeyError, ValueError):
            pass
    return evs


def accounting(root_ip, run_id):
    """The job's last recovery as the rendezvous accounts it (`rlaunch status --json`)."""
    try:
        with urllib.request.urlopen(f"http://{root_ip}:{RDZV_PORT}/v1/jobs/{run_id}", timeout=5) as r:
            status = json.load(r)
    except OSError as e:
        print(f"  no accounting: {e}", file=sys.stderr)
        return None
    rec = status.get("recovery") or {}
    last = (rec.get("recoveries") or [None])[-1]
    return {"recovery": last, "goodput": rec.get("goodput")}


def agent_command(args, launcher, script, nnodes, run_id, root_ip, host_a):
    """One host's launcher command line, 2 ranks a host and 3 restarts: rlaunch on the rendezvous at
    `root_ip` (node TTL 2 s), or torchrun on a c10d store on host a (it runs `script` without its
    python)."""
    common = ["--nnodes", nnodes, "--nproc-per-node", "2", "--max-restarts", "3"]
    if launcher == "rlaunch":
        return [args.rlaunch, *common, "--rdzv-backend", "rlaunch", "--rdzv-endpoint", f"{root_ip}:{RDZV_PORT}",
                "--rdzv-id", run_id, "--rdzv-conf", "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1",
                *script]
    return [args.torchrun, *common, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{host_a['ip']}:{C10D_PORT}",
            "--rdzv-id", "bench", "--rdzv-conf", "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
            *script[1:]]


class Agents:
    """The launchers of a run, one per host, their output in OUT/agent-HOST.log."""

    def __init__(self, net, out, cmd, env, host_env=None):
        # host_env(h): variables of host h's launcher alone (None: none).
        self.net, self.out, self.cmd, self.env, self.procs = net, out, cmd, env, []
        self.host_env = host_env or (lambda h: {})

    def start(self, h):
        log = open(os.path.join(self.out, f"agent-{h['name']}.log"), "w")
        env = dict(self.env, BENCH_HOST=h["name"], **self.host_env(h))
        self.procs.append(subprocess.Popen(self.net.prefix(h) + self.cmd, env=env,
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT))

    def stop(self):
        """Every launcher killed, and whatever still runs in the hosts' namespaces."""
        for p in self.procs:
            try:
                p.kill()
            except ProcessLookupError:
                pass
        for h in self.net.hosts:
            recovery.kill_ns(h["ns"])
        for p in self.procs:
            p.wait()


def run(label, launcher, mode, args, net, root_ip):
    out = tempfile.mkdtemp(prefix="rlaunch-bench-snapshot-")
    os.chmod(out, 0o777)
    a, b, c = net.hosts
    env = dict(os.environ, RLAUNCH_LOG="info", PYTHONUNBUFFERED="1", GLOO_SOCKET_IFNAME="eth0", LOGLEVEL="INFO")
    script = [args.python, os.path.join(HERE, "train_ddp.py"), out, mode, str(args.steps)]
    cmd = agent_command(args, launcher, script, "2", "bench-" + mode, root_ip, a)
    agents = Agents(net, out, cmd, env)
    start = agents.start
    try:
        start(a)
        start(b)
        if not wait_for(lambda: any(e == "step" and s >= 10 for e, s, *_ in events(out)), 120):
            raise RuntimeError(f"{label}: no training (logs in {out})")
        start(c)
        if not wait_for(lambda: any(e == "step" and s >= args.cut for e, s, *_ in events(out)), 120):
            raise RuntimeError(f"{label}: never reached step {args.cut} (logs in {out})")
        t0 = time.time()
        net.cut_link(b)
        time.sleep(0.3)
        net.kill_all(b)

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
        before = {s: l for e, s, t, l, w in evs if e == "step" and t <= t0 + 0.3}
        last = max(before) if before else None
        if got is None:
            return {"label": label, "again": None, "redone": None, "equal": None, "evs": evs, "t0": t0, "last": last}
        r_step, t_first = got
        wait_for(lambda: any(e == "done" for e, *_ in events(out)), 120)
        acct = accounting(root_ip, "bench-" + mode) if launcher == "rlaunch" else None
        if acct is not None:
            # What an operator sees (`rlaunch status`), kept for the results.
            st = subprocess.run([args.rlaunch, "status", "--rdzv-endpoint", f"{root_ip}:{RDZV_PORT}",
                                 "--rdzv-id", "bench-" + mode], capture_output=True, text=True, timeout=20)
            acct["status"] = st.stdout
        evs = events(out)
        after = {}
        for e, s, t, l, w in evs:
            if e == "step" and t > t_first - 1e-6 and s not in after:
                after[s] = l
        redone = [s for s in before if s > r_step]
        equal = sum(1 for s in redone if s in after and abs(float(after[s]) - float(before[s])) <= 1e-5 * abs(float(before[s])))
        exact = sum(1 for s in redone if after.get(s) == before[s])
        return {"label": label, "again": t_first - t0, "redone": len(redone), "equal": (equal, exact, len(redone)),
                "evs": evs, "t0": t0, "last": last, "resumed": r_step, "acct": acct}
    finally:
        agents.stop()
        net.restore = None
        if args.keep:
            print(f"  logs kept in {out}", file=sys.stderr)
        else:
            shutil.rmtree(out, ignore_errors=True)


def start_services(net, rendezvous, data, side):
    """etcd and `rlaunch-rendezvous --store etcd` in the root namespace of `net`, their data and
    logs in `data`, their processes appended to `side`; answers the root namespace's address."""
    root_ip = f"10.77.{net.subnet}.1"
    side.append(subprocess.Popen(["etcd", "--data-dir", os.path.join(data, "d"),
                                  "--listen-client-urls", f"http://{root_ip}:{ETCD_PORT}",
                                  "--advertise-client-urls", f"http://{root_ip}:{ETCD_PORT}",
                                  "--listen-peer-urls", f"http://{root_ip}:{ETCD_PEER}",
                                  "--initial-advertise-peer-urls", f"http://{root_ip}:{ETCD_PEER}",
                                  "--initial-cluster", f"default=http://{root_ip}:{ETCD_PEER}"],
                                 stdout=open(os.path.join(data, "etcd.log"), "w"), stderr=subprocess.STDOUT))
    side.append(subprocess.Popen([rendezvous, "--listen", f"{root_ip}:{RDZV_PORT}", "--store", "etcd",
                                  "--etcd-endpoints", f"http://{root_ip}:{ETCD_PORT}"],
                                 stdout=open(os.path.join(data, "rdzv.log"), "w"), stderr=subprocess.STDOUT))
    if not wait_for(lambda: listening(root_ip, RDZV_PORT), 20):
        raise SystemExit("the rendezvous did not start")
    return root_ip


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--cut", type=int, default=133)
    ap.add_argument("--wait", type=float, default=60.0)
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target/debug/rlaunch"))
    ap.add_argument("--rendezvous", default=os.path.join(ROOT, "target/debug/rlaunch-rendezvous"))
    ap.add_argument("--torchrun", default=os.path.join(ROOT, ".venv/bin/torchrun"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--rows", default="0,1,2", help="which rows to run (0: snapshots, 1: disk, 2: torchrun)")
    ap.add_argument("--out", default=os.path.join(HERE, "NODE_LOSS.md"))
    args = ap.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("run as root: the hosts are network namespaces")
    rows = []
    wanted = [int(x) for x in args.rows.split(",")]
    for i, (label, launcher, mode) in enumerate([("rlaunch, snapshot every step", "rlaunch", "snapshot"),
                                  ("rlaunch, disk checkpoint every 50 steps", "rlaunch", "disk"),
                                  ("torchrun (c10d), disk checkpoint every 50 steps", "torchrun", "disk")]):
        if i not in wanted:
            continue
        net = Net(3)
        data = tempfile.mkdtemp(prefix="rlaunch-bench-etcd-")
        side = []
        try:
            root_ip = start_services(net, args.rendezvous, data, side)
            for attempt in range(3):
                try:
                    r = run(label, launcher, mode, args, net, root_ip)
                    break
                except RuntimeError as e:
                    # torchrun's first round is flaky here (bench/recovery/RESULTS.md): again.
                    print(f"{label}: {e}; again", flush=True)
            else:
                r = {"label": label, "again": None, "redone": None, "equal": None, "evs": [], "t0": 0, "last": None}
        finally:
            for p in side:
                p.kill()
                p.wait()
            net.close()
            shutil.rmtree(data, ignore_errors=True)
        rows.append(r)
        print(f"{label}: resumed from {r.get('resumed')}, last step before the cut {r['last']}, "
              f"again after {r['again']}, redone {r['redone']}, equal {r['equal']}", flush=True)

    table = ["| | fault → first training step again | steps computed again | their losses equal the first computation's |",
             "|---|---|---|---|"]
    for r in rows:
        again = f"{r['again']:.2f} s" if r["again"] is not None else f"never (bounded wait {args.wait:.0f} s)"
        redone = str(r["redone"]) if r["redone"] is not None else "–"
        eq = (f"{r['equal'][0]} of {r['equal'][2]} (bit for bit: {r['equal'][1]})" if r["equal"] else "–")
        table.append(f"| {r['label']} | {again} | {redone} | {eq} |")
    table += ["", "Where the seconds went, as the rendezvous accounts the recovery (`rlaunch status`; its clock,",
              "the agents' reports; the fault dated at host b's last heartbeat before the cut):", "",
              "| | noticing | re-forming | starting | restoring | computing again | steps redone | fault → training again |",
              "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rec = (r.get("acct") or {}).get("recovery")
        if not rec:
            continue
        p = rec["phases"]
        cell = lambda ms: f"{ms / 1000:.2f} s" if ms is not None else "–"
        redone = p.get("steps_redone")
        table.append(f"| {r['label']} | {cell(p.get('noticing_ms'))} | {cell(p.get('reforming_ms'))} | "
                     f"{cell(p.get('starting_ms'))} | {cell(p.get('restoring_ms'))} | {cell(p.get('computing_again_ms'))} | "
                     f"{redone if redone is not None else '–'} | {cell(rec.get('lost_ms'))} |")
    for r in rows:
        st = (r.get("acct") or {}).get("status")
        if st:
            table += ["", f"`rlaunch status` after the {r['label']} run:", "", "```", st.rstrip(), "```"]
    text = "\n".join(table)
    print(text)
    plot(rows, os.path.join(HERE, "node_loss.png"))
    if args.out:
        with open(args.out, "w") as f:
            f.write(HEAD.format(date=time.strftime("%Y-%m-%d"), steps=args.steps, cut=args.cut) + text + "\n" + TAIL)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        pts = [(t - r["t0"], s) for e, s, t, l, w in r["evs"] if e == "step"]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", markersize=2, label=r["label"])
    ax.axvline(0, color="gray", linestyle="--", linewidth=1)
    ax.set_xlabel("seconds since host b's link was cut")
    ax.set_ylabel("step (rank 0)")
    ax.set_xlim(-5, 30)
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title("A node lost at step 133: where training resumes")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


HEAD = """# A node lost mid-training: snapshots in the agents' memory vs disk checkpoints vs torchrun

Date: {date}. Machine: 2 cores, 24 GiB, PyTorch 2.15 (CPU, gloo), rlaunch's debug build. Script:
`bench/snapshot/node_loss.py` (as root), one run per row.

Three hosts as network namespaces; etcd and `rlaunch-rendezvous --store etcd` in the root
namespace (torchrun: its c10d store on host a). Hosts a and b run 2 ranks each of
`train_ddp.py` (DDP, gloo, an MLP of 280k parameters, about 8 steps a second, {steps} steps);
host c waits as a spare. At step {cut}, host b's link is cut and 0.3 s later every process of
it is killed. "Steps computed again": steps logged before the cut that were computed again
after the resume. Their losses are compared with the first computation's (relative 1e-5; a
new four-rank process group may sum in another order, so the last bit can differ).

"""

TAIL = """
![step against time since the fault](node_loss.png)

- With a snapshot every step, the job resumes from the last step before the cut: at most one
  step is computed again (the step in flight when host b went, whose copy to its buddy may not
  have arrived), and its loss comes out as before. With a disk checkpoint every 50 steps, the 34
  steps since step 99 are computed again. torchrun's c10d rendezvous does not come back: host
  a's agent, restarting its group for the spare, waits for a round that never closes.
- Where the seconds go is the rendezvous' own account of the recovery (the second table, as
  `rlaunch status`, the status page and `/metrics` show it): noticing runs from host b's last
  heartbeat to the verdict (TTL 2 s; on etcd the replica that hears a node suspects it at the
  TTL less the probe timeout, so the probes end with the TTL), re-forming until the survivor
  and the spare are in round 2, starting until every rank asked `rlaunch.snapshot.load` for its
  state (warm workers: no Python or torch to import; `init_process_group` and DDP's set-up on 2
  cores), restoring until every rank has it (the spare fetches host b's parts from its buddy).
  The disk row has no snapshots, so starting there ends when the workers were handed over, and
  reading the checkpoint and the steps computed again are not in the account.
"""


if __name__ == "__main__":
    main()
