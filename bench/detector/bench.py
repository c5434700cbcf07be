"""Failure detection under packet loss: rlaunch against torchrun's c10d rendezvous, side by side.

The setup is bench/recovery's (imported from it, not copied): two hosts a and b as network
namespaces on a private bridge, one worker each running bench/recovery/train_loop.py (gloo
all_reduce of 64 KiB every 50 ms) under `--nnodes 1:2`, the rendezvous endpoint on host a
(rlaunch's agent-hosted server, torchrun's c10d TCPStore). Once both workers train:

- loss5, loss15, loss30: random loss of 5/15/30 % of the packets on host b's link, both ways,
  for --duration seconds. Counted: the worker starts on each host during that window (each is
  a restart caused by a node falsely judged lost: nothing else fails), whether the job still
  runs with WORLD_SIZE 2 at the end (both workers alive, started with WORLD_SIZE=2), and the
  all_reduce rate of host a (against its clean rate just before).
- lossrdzv15: 15 % loss only between host b and the rendezvous, a <-> b clean. rlaunch: a
  standalone `rlaunch-rendezvous --store memory` in the root namespace (on the bridge's own
  address 10.77.X.1), loss on b <-> 10.77.X.1 only. torchrun: its c10d store must live on one
  of the hosts, so it stays on host a and the loss is on b <-> a's TCP port 29400 only (the
  store: keep-alives, rendezvous state and, since torchrun hands its store to the workers, the
  workers' env:// store; gloo's own connections are clean).
- cut, kill: host b's link cut / every process of host b killed; detection = from the fault
  to the survivor's worker restarted with WORLD_SIZE=1 (bench/recovery's run_once, as is).

How loss is made: iptables `-m statistic --mode random --probability P -j DROP` in the INPUT
chain of the receiving side of each direction (host b's namespace for packets to b; host a's
namespace, or the root namespace for the standalone server, for packets from b), so it works
whether or not bridged traffic goes through iptables, and no sender sees a local send error.
Each DROP rule has a counting rule before it: the measured loss is in the results. Before each
run a UDP echo probe (udp_probe.py; the image has no ping) checks the rules: with loss P each
way a round trip is lost with probability 1 - (1 - P)^2.

Launchers (--launchers): `rlaunch` (heartbeat 0.5 s, TTL 2 s: --rdzv-conf
heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=60 --shutdown-timeout 3; peer
watching at its defaults, 0.1 s pings and a 0.5 s stall bound), `rlaunch-nopeer` (the same with
peer_interval=0: the detector as it was before peer watching),
`torchrun-15s` (c10d defaults: keep_alive_interval=5, keep_alive_max_attempt=3),
`torchrun-3s` (keep_alive_interval=1, keep_alive_max_attempt=3). last_call_timeout=1 for all
(torchrun's default 30 s would be in every re-rendezvous); --max-restarts 10 for all (so that
a few false losses do not exhaust the budget and end the count).

Usage (root), from the repository root:
  .venv/bin/python bench/detector/bench.py [--scenarios loss5,loss15,loss30,lossrdzv15,cut,kill]
      [--launchers rlaunch,torchrun-15s,torchrun-3s] [--duration 60] [--reps N] [--append]
      [--wait-binaries 0] [--out bench/detector/RESULTS.md]
Results: the table (printed and --out), every run as JSON lines in RESULTS.jsonl next to it,
and RESULTS.png (restarts and all_reduce rate against the loss rate). With --append the runs
are added to RESULTS.jsonl, and the table is made from the newest session of each
(scenario, launcher): run the torchrun rows and the rlaunch rows at different times.
`--report` runs nothing and makes the table and plot again from RESULTS.jsonl.
"""

import argparse
import datetime
import importlib.util
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

# bench/recovery/bench.py as a module (a plain `import bench` would find this file first).
_spec = importlib.util.spec_from_file_location("recovery_bench", os.path.join(ROOT, "bench", "recovery", "bench.py"))
recovery = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recovery)

PORT = recovery.PORT
PROBE_PORT = 29555
PROBE = os.path.join(HERE, "udp_probe.py")
LOSS_COMMENT = f"rlaunch-detector-loss pid={os.getpid()}"

CONFIGS = {
    "rlaunch": {
        "kind": "rlaunch",
        "conf": "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=60,peer_interval=0.1",
        "label": "rlaunch (peer watching 0.1 s, stall bound 0.5 s; heartbeat 0.5 s, TTL 2 s)",
    },
    "rlaunch-nopeer": {
        "kind": "rlaunch",
        "conf": "heartbeat_interval=0.5,node_ttl=2,last_call_timeout=1,join_timeout=60,peer_interval=0",
        "label": "rlaunch without peer watching (heartbeat 0.5 s, TTL 2 s; before 2026-11-29)",
    },
    "torchrun-15s": {
        "kind": "torchrun",
        "conf": "last_call_timeout=1,keep_alive_interval=5,keep_alive_max_attempt=3",
        "label": "torchrun c10d default (keep-alive 5 s x 3 = 15 s)",
    },
    "torchrun-3s": {
        "kind": "torchrun",
        "conf": "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=3",
        "label": "torchrun c10d 3 s (keep-alive 1 s x 3)",
    },
}
LOSS = {"loss5": 0.05, "loss15": 0.15, "loss30": 0.30, "lossrdzv15": 0.15}
FAULTS = ("cut", "kill")
SCENARIOS = list(LOSS) + list(FAULTS)


def log(msg):
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- launcher command lines


def agent_cmd(launcher, endpoint_ip, out, args):
    """recovery.run_once calls this (as recovery.agent_cmd) with a launcher name from CONFIGS;
    the rlaunch one is named `rlaunch`, which run_once also checks to start host a first."""
    cfg = CONFIGS[launcher]
    script = os.path.join(recovery.HERE, "train_loop.py")
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-id", "bench", "--max-restarts", str(args.max_restarts)]
    endpoint = f"{endpoint_ip}:{PORT}"
    if cfg["kind"] == "rlaunch":
        return [args.rlaunch, *common, "--rdzv-backend", "rlaunch", "--rdzv-endpoint", endpoint,
                "--rdzv-conf", cfg["conf"], "--shutdown-timeout", "3", script, out]
    return [args.torchrun, *common, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
            "--rdzv-conf", cfg["conf"], script, out]


recovery.agent_cmd = agent_cmd


# ---------------------------------------------------------------- loss rules


def ipt(ns, *rule, check=True):
    argv = (["ip", "netns", "exec", ns] if ns else []) + ["iptables", "-w", *rule]
    p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {p.stderr.strip()}")
    return p


class LossRules:
    """Random DROP rules in INPUT chains (ns None: the root namespace), each after a rule that
    only counts the same packets; remove() deletes them all (also after a partial add)."""

    def __init__(self):
        self.rules = []  # (ns, direction, spec) in the order added

    def add(self, ns, direction, match, p):
        tag = ["-m", "comment", "--comment", LOSS_COMMENT]
        drop = ["INPUT", *match, "-m", "statistic", "--mode", "random", "--probability", f"{p}", *tag, "-j", "DROP"]
        count = ["INPUT", *match, *tag]
        for spec in (drop, count):  # each inserted at the top: the counting rule ends up first
            ipt(ns, "-I", *spec)
            self.rules.append((ns, direction, spec))

    def counters(self):
        """{direction: {"packets": seen, "dropped": dropped, "loss": dropped / seen}}."""
        res = {}
        for ns in {ns for ns, _, _ in self.rules}:
            directions = {d for n, d, _ in self.rules if n == ns}
            (direction,) = directions  # one direction per namespace
            lines = ipt(ns, "-S", "INPUT", "-v").stdout.splitlines()
            c = res.setdefault(direction, {"packets": 0, "dropped": 0})
            for line in lines:
                if LOSS_COMMENT not in line:
                    continue
                words = line.split()
                pkts = int(words[words.index("-c") + 1]) if "-c" in words else 0
                c["dropped" if "statistic" in words else "packets"] += pkts
        for c in res.values():
            c["loss"] = round(c["dropped"] / c["packets"], 4) if c["packets"] else None
        return res

    def remove(self):
        while self.rules:
            ns, _, spec = self.rules.pop()
            ipt(ns, "-D", *spec, check=False)


def sweep_root_rules():
    """Deletes any loss rule of this process left in the root namespace (after an interrupt)."""
    p = subprocess.run(["iptables", "-w", "-S", "INPUT"], capture_output=True, text=True)
    for line in p.stdout.splitlines():
        if LOSS_COMMENT in line and line.startswith("-A "):
            ipt(None, "-D", *shlex.split(line)[1:], check=False)


def make_rules(scenario, launcher, net, server_ip):
    p = LOSS[scenario]
    a, b = net.hosts
    rules = LossRules()
    try:
        if scenario != "lossrdzv15":
            rules.add(b["ns"], "to b", ["-i", "eth0"], p)
            rules.add(a["ns"], "from b", ["-i", "eth0", "-s", b["ip"]], p)
        elif CONFIGS[launcher]["kind"] == "rlaunch":
            rules.add(b["ns"], "to b", ["-i", "eth0", "-s", server_ip], p)
            rules.add(None, "from b", ["-i", net.bridge, "-s", b["ip"], "-d", server_ip], p)
        else:
            rules.add(b["ns"], "to b", ["-i", "eth0", "-s", a["ip"], "-p", "tcp", "--sport", str(PORT)], p)
            rules.add(a["ns"], "from b", ["-i", "eth0", "-s", b["ip"], "-p", "tcp", "--dport", str(PORT)], p)
    except BaseException:
        rules.remove()
        raise
    return rules


def loss_where(scenario, launcher):
    if scenario != "lossrdzv15":
        return "b's link, both ways"
    if CONFIGS[launcher]["kind"] == "rlaunch":
        return "b <-> standalone rendezvous (root ns) only"
    return "b <-> a:29400 (c10d store on a) only"


def probe(src_ns, dst_ip, n):
    p = subprocess.run(["ip", "netns", "exec", src_ns, sys.executable, PROBE, "client", dst_ip, str(PROBE_PORT), str(n)],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
    try:
        return float(p.stdout.strip())
    except ValueError:
        raise RuntimeError(f"udp probe failed: {p.stdout} {p.stderr}")


# ---------------------------------------------------------------- events of train_loop.py


def read_events(out):
    try:
        lines = open(os.path.join(out, "events.log")).read().splitlines()
    except OSError:
        return []
    evs = []
    for line in lines:
        parts = line.split()
        if not parts:
            continue
        kv = dict(x.split("=", 1) for x in parts[1:] if "=" in x)
        try:
            evs.append({"ev": parts[0], "t": float(kv["t"]), "host": kv["host"], "world": kv["world"],
                        "pid": int(kv.get("pid", "0"))})
        except (KeyError, ValueError):
            pass
    return evs


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is not a running worker
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def steps(evs, host, t_from, t_to):
    """all_reduces done with WORLD_SIZE 2 by host in [t_from, t_to] (the loop logs every 20th)."""
    return sum(20 if e["ev"] == "step" else 1 for e in evs
               if e["host"] == host and e["world"] == "2" and e["ev"] in ("step", "step1") and t_from <= e["t"] <= t_to)


def clean_rate(evs, host, t_from, t_to):
    """all_reduces/s of one worker process from its step events' times (one every 20 steps)."""
    by = {}
    for e in evs:
        if e["host"] == host and e["ev"] == "step" and e["world"] == "2" and t_from <= e["t"] <= t_to:
            by.setdefault(e["pid"], []).append(e["t"])
    ts = max(by.values(), key=len, default=[])
    return round(20 * (len(ts) - 1) / (ts[-1] - ts[0]), 2) if len(ts) > 1 and ts[-1] > ts[0] else None


# ---------------------------------------------------------------- one packet-loss run


def start_agents(launcher, net, endpoint_ip, out, args, wait_a_first):
    env = dict(os.environ, RLAUNCH_PYTHON=args.python, RLAUNCH_LOG="info", PYTHONUNBUFFERED="1",
               GLOO_SOCKET_IFNAME="eth0", LOGLEVEL="INFO")
    procs = []
    a = net.hosts[0]
    for h in net.hosts:
        logf = open(os.path.join(out, f"{launcher}-{h['name']}.log"), "w")
        procs.append(subprocess.Popen(net.prefix(h) + agent_cmd(launcher, endpoint_ip, out, args),
                                      env=dict(env, BENCH_HOST=h["name"]), stdin=subprocess.DEVNULL,
                                      stdout=logf, stderr=subprocess.STDOUT))
        logf.close()
        if wait_a_first and h is a and not recovery.wait_for(lambda: recovery.listening(a["ip"], PORT), 30):
            return procs, f"{launcher}: host a does not serve the rendezvous"
    return procs, None


def run_loss(launcher, scenario, args):
    cfg = CONFIGS[launcher]
    out = tempfile.mkdtemp(prefix="rlaunch-bench-detector-")
    os.chmod(out, 0o777)
    net = recovery.Net(2)
    procs, others, rules = [], [], None
    keep = args.keep
    rec = {"scenario": scenario, "launcher": launcher, "loss": LOSS[scenario], "where": loss_where(scenario, launcher),
           "duration_s": args.duration, "rlaunch_built": built(args.rlaunch) if cfg["kind"] == "rlaunch" else None}
    try:
        a, b = net.hosts
        root_ip = f"10.77.{net.subnet}.1"
        standalone = scenario == "lossrdzv15" and cfg["kind"] == "rlaunch"
        endpoint = root_ip if standalone else a["ip"]
        if standalone:
            with open(os.path.join(out, "rendezvous.log"), "w") as slog:
                others.append(subprocess.Popen([args.rendezvous, "--listen", f"{root_ip}:{PORT}", "--store", "memory"],
                                               stdin=subprocess.DEVNULL, stdout=slog, stderr=subprocess.STDOUT))
            if not recovery.wait_for(lambda: recovery.listening(root_ip, PORT), 30):
                raise RuntimeError("the standalone rendezvous does not listen")

        # The rules drop what they should: a UDP round-trip probe with them in place (then removed).
        targets = {"b->a": (a["ns"], a["ip"])}
        if standalone:
            targets["b->rendezvous"] = (None, root_ip)
        for ns, ip in targets.values():
            argv = [sys.executable, PROBE, "server", ip, str(PROBE_PORT), "120"]
            others.append(subprocess.Popen((["ip", "netns", "exec", ns] if ns else []) + argv, stdin=subprocess.DEVNULL))
        time.sleep(0.5)
        rules = make_rules(scenario, launcher, net, root_ip)
        rec["probe_round_trip_loss_pct"] = {k: probe(b["ns"], ip, args.probe_count) for k, (ns, ip) in targets.items()}
        rules.remove()
        rules = None
        log(f"  probe (UDP round trips lost, expect ~{100 * (1 - (1 - LOSS[scenario]) ** 2):.0f} % where the rules apply): "
            f"{rec['probe_round_trip_loss_pct']}")

        procs, err = start_agents(launcher, net, endpoint, out, args, wait_a_first=cfg["kind"] == "rlaunch" and not standalone)
        if err:
            raise RuntimeError(err)
        steady = lambda: {e["host"] for e in read_events(out) if e["ev"] == "step" and e["world"] == "2"} == {"a", "b"}
        if not recovery.wait_for(steady, 120):
            raise RuntimeError(f"{launcher}: the two hosts did not start training (logs in {out})")
        time.sleep(args.baseline)
        t0 = time.time()
        rules = make_rules(scenario, launcher, net, root_ip)
        while time.time() < t0 + args.duration and any(p.poll() is None for p in procs):
            time.sleep(0.5)
        t1 = time.time()
        rec["measured_loss"] = rules.counters()
        evs = read_events(out)
        rules.remove()
        rules = None

        starts = [e for e in evs if e["ev"] == "start" and t0 <= e["t"] <= t1]
        rec["restarts"] = {h: sum(1 for e in starts if e["host"] == h) for h in ("a", "b")}
        rec["restart_worlds"] = {h: [int(e["world"]) if e["world"].isdigit() else e["world"]
                                     for e in starts if e["host"] == h] for h in ("a", "b")}
        rec["restart_times_s"] = {h: [round(e["t"] - t0, 2) for e in starts if e["host"] == h] for h in ("a", "b")}
        end = {}
        for h in ("a", "b"):
            last = [e for e in evs if e["ev"] == "start" and e["host"] == h]
            last = last[-1] if last else None
            prog = [e["t"] for e in evs if e["host"] == h and e["ev"] in ("step", "step1")]
            end[h] = {"world": last["world"] if last else None, "worker_alive": bool(last and alive(last["pid"])),
                      "last_progress_s_before_end": round(t1 - prog[-1], 2) if prog else None}
        rec["agents_exit"] = [p.poll() for p in procs]
        rec["end"] = end
        rec["running_world2_at_end"] = all(v["world"] == "2" and v["worker_alive"] for v in end.values()) and all(
            c is None for c in rec["agents_exit"])
        window = t1 - t0
        rec["window_s"] = round(window, 2)
        rec["allreduce_per_s_clean"] = clean_rate(evs, "a", t0 - args.baseline, t0)
        rec["allreduce_per_s_loss"] = round(steps(evs, "a", t0, t1) / window, 2)

        # Loss gone: does the job train with WORLD_SIZE 2 again (bounded by --settle)?
        def both_train():
            evs2 = read_events(out)
            return all(any(e["host"] == h and e["world"] == "2" and e["ev"] in ("step", "step1") and e["t"] > t1
                           for e in evs2) for h in ("a", "b"))
        got = recovery.wait_for(both_train, args.settle, step=0.2)
        rec["world2_training_after_loss_removed"] = bool(got)
        if sum(rec["restarts"].values()) or not rec["running_world2_at_end"]:
            keep = True
        return rec
    except RuntimeError:
        keep = True
        raise
    finally:
        if rules:
            rules.remove()
        for p in procs + others:
            try:
                p.kill()
            except ProcessLookupError:
                pass
        net.close()
        for p in procs + others:
            p.wait()
        sweep_root_rules()
        if keep:
            rec["logs"] = out
            log(f"  logs kept in {out}")
        else:
            shutil.rmtree(out, ignore_errors=True)


def run_fault(launcher, fault, args):
    stamp = built(args.rlaunch) if CONFIGS[launcher]["kind"] == "rlaunch" else None
    r = recovery.run_once(launcher, fault, args)
    return {"scenario": fault, "launcher": launcher, "restarted_s": r[0], "training_s": r[1], "wait_s": args.wait,
            "rlaunch_built": stamp}


# ---------------------------------------------------------------- tables


def fmt_s(v):
    return f"{v:.2f} s" if v is not None else "-"


def med_cell(vals, wait):
    got = [v for v in vals if v is not None]
    if not vals:
        return "-", None
    if len(got) < len(vals):
        cell = f"not within {wait:.0f} s ({len(vals) - len(got)} of {len(vals)} runs)"
        return cell + (f"; others {statistics.median(got):.2f} s" if got else ""), None
    m = statistics.median(got)
    return (f"{m:.2f} s" + (f" (min {min(got):.2f}, max {max(got):.2f})" if len(got) > 1 else "")), m


def newest_sessions(records):
    """Per (scenario, launcher), the runs of the newest session that measured it."""
    by = {}
    for r in records:
        by.setdefault((r["scenario"], r["launcher"]), []).append(r)
    res = {}
    for k, rs in by.items():
        s = max(r["session"] for r in rs)
        res[k] = [r for r in rs if r["session"] == s]
    return res


def loss_table(sel, launchers):
    rows = ["| scenario | launcher | loss applied: where, measured drop (to b / from b) | false-loss restarts during the window (host a, host b) | job at the end of the window | all_reduces/s on host a: clean -> under loss | vs rlaunch (all_reduces/s under loss) |",
            "|---|---|---|---|---|---|---|"]
    for sc in LOSS:
        base = None
        if ("rlaunch" in launchers) and (sc, "rlaunch") in sel:
            base = statistics.median(r["allreduce_per_s_loss"] for r in sel[(sc, "rlaunch")])
        for ln in launchers:
            runs = sel.get((sc, ln))
            if not runs:
                continue
            r0 = runs[0]
            ml = r0.get("measured_loss", {})
            drop = " / ".join(f"{100 * ml[d]['loss']:.1f} %" if ml.get(d, {}).get("loss") is not None else "-"
                              for d in ("to b", "from b"))
            parts = []
            for r in runs:
                ra, rb = r["restarts"]["a"], r["restarts"]["b"]
                w = "; ".join(f"{h}: W{','.join(str(x) for x in r['restart_worlds'][h])}" for h in ("a", "b") if r["restart_worlds"][h])
                parts.append(f"{ra}, {rb}" + (f" ({w})" if w else ""))
            restarts = " / ".join(parts)
            ends = []
            for r in runs:
                if r["running_world2_at_end"]:
                    e = "running, WORLD_SIZE 2"
                    stall = max((v["last_progress_s_before_end"] or 0) for v in r["end"].values())
                    if stall > 20:
                        e += f" but stalled (no 20-all_reduce mark in the last {stall:.0f} s; " + (
                            "trains again once the loss ends)" if r["world2_training_after_loss_removed"]
                            else "not training again within the settle time)")
                else:
                    e = "not running with WORLD_SIZE 2 (" + ", ".join(
                        f"{h}: W{v['world']}{'' if v['worker_alive'] else ' exited'}" for h, v in r["end"].items()) + (
                        f"; agents exited {r['agents_exit']}" if any(c is not None for c in r["agents_exit"]) else "") + ")"
                    e += "; W2 again after the loss ended" if r["world2_training_after_loss_removed"] else "; not W2 again within the settle time"
                ends.append(e)
            cl = [r["allreduce_per_s_clean"] for r in runs if r["allreduce_per_s_clean"]]
            clean = f"{statistics.median(cl):.1f}" if cl else "-"
            lossy = statistics.median(r["allreduce_per_s_loss"] for r in runs)
            ratio = f"{lossy / base:.2f}x" if base and ln != "rlaunch" else ""
            lossy = f"{lossy:.1f}" if lossy else f"< {20 / r0['duration_s']:.2f} (under 20 in the window)"
            rows.append(f"| {sc} ({100 * r0['loss']:.0f} %) | {CONFIGS[ln]['label']} | {r0['where']}; {drop} | {restarts} | {' / '.join(ends)} | {clean} -> {lossy} | {ratio} |")
    return "\n".join(rows)


def fault_table(sel, launchers):
    rows = ["| fault | launcher | detection: survivor's worker restarted with WORLD_SIZE 1 | training again (first all_reduce) | detection vs rlaunch |",
            "|---|---|---|---|---|"]
    for fault in FAULTS:
        base = None
        if (fault, "rlaunch") in sel:
            base = med_cell([r["restarted_s"] for r in sel[(fault, "rlaunch")]], 60)[1]
        for ln in launchers:
            runs = sel.get((fault, ln))
            if not runs:
                continue
            wait = runs[0]["wait_s"]
            det, m = med_cell([r["restarted_s"] for r in runs], wait)
            tr, _ = med_cell([r["training_s"] for r in runs], wait)
            ratio = ""
            if ln != "rlaunch" and base:
                ratio = f"{m / base:.1f}x" if m is not None else f"> {wait / base:.0f}x (bounded wait)"
            what = "cut host b's link" if fault == "cut" else "kill every process of host b"
            n = "" if "runs)" in det else f" ({len(runs)} runs)"
            rows.append(f"| {what} | {CONFIGS[ln]['label']} | {det}{n} | {tr} | {ratio} |")
    return "\n".join(rows)


def plot(sel, launchers, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("no matplotlib: no plot")
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    drawn = False
    for k, ln in enumerate(launchers):
        xs, ys, zs = [], [], []
        for sc in ("loss5", "loss15", "loss30"):
            runs = sel.get((sc, ln))
            if not runs:
                continue
            xs.append(100 * LOSS[sc])
            ys.append(statistics.median(r["restarts"]["a"] + r["restarts"]["b"] for r in runs))
            zs.append(statistics.median(100 * r["allreduce_per_s_loss"] / r["allreduce_per_s_clean"]
                                        if r["allreduce_per_s_clean"] else float("nan") for r in runs))
        if xs:
            style = dict(marker="osD^"[k % 4], linestyle=["-", "--", ":", "-."][k % 4], label=CONFIGS[ln]["label"])
            ax1.plot(xs, ys, **style)
            ax2.plot(xs, zs, **style)
            drawn = True
    if not drawn:
        plt.close(fig)
        return False
    ax1.set_xlabel("packet loss on host b's link, each way (%)")
    ax1.set_ylabel("worker restarts in the window (a + b)")
    ax1.set_title("False node-loss restarts")
    ax2.set_xlabel("packet loss on host b's link, each way (%)")
    ax2.set_ylabel("host a's all_reduce rate (% of clean)")
    ax2.set_title("Training under loss")
    ax2.set_ylim(bottom=0)
    from matplotlib.ticker import MaxNLocator
    ax1.yaxis.set_major_locator(MaxNLocator(integer=True))
    top = max([ln.get_ydata().max() for ln in ax1.get_lines()] + [1])
    ax1.set_ylim(-0.3, top + 0.5)  # lines at 0 stay visible
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def machine():
    mem = ""
    try:
        kb = int(next(line for line in open("/proc/meminfo") if line.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{os.cpu_count()} cores{mem}"


def write_results(records, launchers_order, args):
    sel = newest_sessions(records)
    present = [ln for ln in launchers_order if any(k[1] == ln for k in sel)]
    sessions = {}
    for (sc, ln), rs in sel.items():
        for r in rs:
            b = r.get("rlaunch_build", "")
            if r.get("rlaunch_built"):  # the build each run started with
                b = b.rsplit(" of ", 1)[0] + " of " + r["rlaunch_built"]
            sessions.setdefault(ln, set()).add((r["date"], r.get("torch", "?"), b))
    head = [f"# Failure detection under packet loss: rlaunch vs torchrun (c10d)", "",
            f"Machine: {machine()} (shared with other work while measuring). Script: `bench/detector/bench.py` (as root).",
            "Measured:"]
    for ln in present:
        for date, torch, build in sorted(sessions[ln]):
            head.append(f"- {CONFIGS[ln]['label']}: {date}, PyTorch {torch}" + (f", {build}" if build else ""))
    head.append("")
    text = "\n".join(head) + "\n" + RESULTS_DOC
    if any(k[0] in LOSS for k in sel):
        text += "\n## Packet loss\n\n" + loss_table(sel, present) + "\n"
    if any(k[0] in FAULTS for k in sel):
        text += "\n## Node lost (detection time)\n\n" + fault_table(sel, present) + "\n"
    text += RESULTS_NOTES
    print()
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        log(f"written to {args.out}")
        png = os.path.splitext(args.out)[0] + ".png"
        if plot(sel, present, png):
            log(f"plot written to {png}")


RESULTS_DOC = """
Two hosts (network namespaces a and b on a bridge), one worker each running
bench/recovery/train_loop.py (gloo all_reduce of 64 KiB every 50 ms) under `--nnodes 1:2
--max-restarts 10`, the rendezvous endpoint on host a unless said otherwise. Loss: iptables
`statistic --mode random` DROP rules in the INPUT chain of the receiving side of each direction
(measured drop rates from the rules' counters in the table). The loss starts once both workers
train and lasts the window (--duration); a worker start in the window is a restart caused by
a node falsely judged lost (nothing else fails). "Job at the end": both workers alive and
started with WORLD_SIZE 2. lossrdzv15: rlaunch with a standalone `rlaunch-rendezvous` in the
root namespace and loss on b <-> it only; torchrun's c10d store has to be on a host, so it
stays on host a and the loss is on b <-> a's TCP port 29400 only (keep-alives, rendezvous
state and, as torchrun hands its store to the workers, their env:// store; gloo is clean).
Timeouts: rlaunch heartbeat 0.5 s, node TTL 2 s; torchrun keep-alive 5 s x 3 (default) or
1 s x 3; last call 1 s for all. Detection (cut, kill): bench/recovery's measurement, from the
fault to the survivor's worker restarted with WORLD_SIZE 1; medians over the runs.
"""


RESULTS_NOTES = """
Reading it (peer watching measured on 2026-11-29, every rlaunch row and the torchrun 3 s cut and
kill rows that day; the other torchrun rows on 2026-11-23; a new run rewrites the tables, not
these notes):

- Peer watching (host a's agent pings host b's every 0.1 s and tells the rendezvous at once)
  brings the survivor's restart down from 2.30 s to 0.82 s after a link cut and from 1.92 s to
  0.16 s after every process of host b is killed (b's host answers "port unreachable"; the
  rendezvous, refused at b's address too, believes it). The verdict comes before the restart:
  the agent stops its old worker and starts the new one in the rest.
- Still no node judged lost under random loss, up to about 30 % each way on host b's whole
  link for 60 s, nor with 15 % on the rendezvous path alone: no worker restarted, and the job
  had both workers with WORLD_SIZE 2 at the end. The watcher's threshold grows with the loss it
  measures (about 1.4 s at 15 % each way, 2.8 s at 30 %), and a silence also needs the
  heartbeats to the rendezvous to be overdue. What the loss did was slow gloo itself (TCP
  retransmissions), the same for every launcher (the all_reduce column measures gloo, not the
  launcher; the "stalled" notes are gloo's TCP backoff).
- torchrun (c10d) is not expected to restart falsely here: nothing watches the keep-alives of
  running nodes. After a kill its survivor fails on the TCP reset and re-rendezvouses, but the
  dead node stays a participant until its keep-alive expires (about 12.8 s with the defaults,
  3.5 s with 1 s x 3); after a link cut no reset arrives and torchrun's survivor waits in
  all_reduce (gloo's timeout, 30 min by default): no recovery within the bounded wait.
- "Training again" includes the new worker's `import torch` and gloo set-up on 2 cores (about
  2.5 s here, more while a Rust build shared the machine during the runs without peer
  watching); warm workers and survivors that keep their process (`bench/resilient`) skip it.
- Loss scenarios are single runs.
"""


# ---------------------------------------------------------------- main


def built(path):
    """The binary's modification time (a rebuild during a session shows in its runs)."""
    return datetime.datetime.fromtimestamp(os.path.getmtime(path)).strftime("%Y-%m-%d %H:%M:%S")


def on_term(signum, frame):
    raise SystemExit(128 + signum)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, of: " + ", ".join(SCENARIOS))
    ap.add_argument("--launchers", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    ap.add_argument("--duration", type=float, default=60.0, help="loss window, seconds")
    ap.add_argument("--reps", type=int, help="runs per cell (default: 1 for the loss scenarios, 3 for cut/kill)")
    ap.add_argument("--wait", type=float, default=60.0, help="bounded wait for recovery after cut/kill, seconds (at most 60)")
    ap.add_argument("--baseline", type=float, default=10.0, help="clean training before the loss, seconds (the clean rate)")
    ap.add_argument("--settle", type=float, default=20.0, help="bounded wait for WORLD_SIZE 2 training after the loss ends")
    ap.add_argument("--max-restarts", type=int, default=10)
    ap.add_argument("--probe-count", type=int, default=200, help="UDP probe datagrams per loss check")
    ap.add_argument("--rlaunch", default=os.path.join(ROOT, "target/debug/rlaunch"))
    ap.add_argument("--rendezvous", default=os.path.join(ROOT, "target/debug/rlaunch-rendezvous"))
    ap.add_argument("--torchrun", default=os.path.join(ROOT, ".venv/bin/torchrun"))
    ap.add_argument("--python", default=os.path.join(ROOT, ".venv/bin/python"))
    ap.add_argument("--wait-binaries", type=float, default=0.0,
                    help="wait up to this many seconds for missing binaries (e.g. a build in progress); launchers "
                         "whose binaries are still missing are skipped")
    ap.add_argument("--append", action="store_true", help="add to the JSON lines file instead of starting it again")
    ap.add_argument("--keep", action="store_true", help="keep every run's logs (runs with restarts keep theirs anyway)")
    ap.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"), help="the table ('' for none); JSON lines and PNG next to it")
    ap.add_argument("--report", action="store_true", help="run nothing: make the table and plot again from the JSON lines")
    args = ap.parse_args()
    args.wait = min(args.wait, 60.0)
    if args.report:
        jsonl = os.path.splitext(args.out or os.path.join(HERE, "RESULTS.md"))[0] + ".jsonl"
        write_results([json.loads(line) for line in open(jsonl) if line.strip()], list(CONFIGS), args)
        return
    scenarios = [s for s in args.scenarios.split(",") if s]
    launchers = [x for x in args.launchers.split(",") if x]
    for s in scenarios:
        if s not in SCENARIOS:
            raise SystemExit(f"unknown scenario {s} (known: {', '.join(SCENARIOS)})")
    for x in launchers:
        if x not in CONFIGS:
            raise SystemExit(f"unknown launcher {x} (known: {', '.join(CONFIGS)})")
    if os.geteuid() != 0:
        raise SystemExit("run as root: the hosts are network namespaces")
    if not os.path.exists(args.python):
        raise SystemExit(f"{args.python} is missing (scripts/install-deps.sh)")

    def needs(ln):
        if CONFIGS[ln]["kind"] == "torchrun":
            return [args.torchrun]
        return [args.rlaunch] + ([args.rendezvous] if "lossrdzv15" in scenarios else [])

    deadline = time.time() + args.wait_binaries
    while any(not os.path.exists(p) for ln in launchers for p in needs(ln)) and time.time() < deadline:
        time.sleep(5)
    for ln in list(launchers):
        missing = [p for p in needs(ln) if not os.path.exists(p)]
        if missing:
            log(f"skipping {ln}: {', '.join(missing)} missing (cargo build --workspace --bins; scripts/install-deps.sh)")
            launchers.remove(ln)
    if not launchers:
        raise SystemExit("nothing to run")

    signal.signal(signal.SIGTERM, on_term)
    torch = subprocess.run([args.python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True).stdout.strip()
    session = datetime.datetime.now().strftime("%Y-%m-%dT%H:%M:%S")
    build = ""
    if "rlaunch" in launchers:
        head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
        build = f"rlaunch debug build (HEAD {head}, work tree possibly modified) of " if head else "rlaunch debug build of "
    jsonl = os.path.splitext(args.out or os.path.join(HERE, "RESULTS.md"))[0] + ".jsonl"
    records = []
    if args.append and os.path.exists(jsonl):
        records = [json.loads(line) for line in open(jsonl) if line.strip()]
    jf = open(jsonl, "a" if args.append else "w")

    try:
        for sc in scenarios:
            reps = args.reps or (1 if sc in LOSS else 3)
            for ln in launchers:
                for i in range(reps):
                    for attempt in range(3):
                        try:
                            log(f"{sc} {ln} run {i + 1}" + (f" (try {attempt + 1})" if attempt else ""))
                            rec = run_loss(ln, sc, args) if sc in LOSS else run_fault(ln, sc, args)
                            break
                        except RuntimeError as e:
                            # torchrun: see bench/recovery (a scale-up deadlock in its first rounds).
                            log(f"{sc} {ln} run {i + 1}: no steady 2-node job ({e}); again")
                    else:
                        log(f"{sc} {ln}: no steady 2-node job in 3 tries; skipped")
                        continue
                    if CONFIGS[ln]["kind"] == "rlaunch":
                        rec["rlaunch_build"] = build + built(args.rlaunch)
                    rec.update(session=session, date=session[:10], rep=i + 1, torch=torch)
                    records.append(rec)
                    jf.write(json.dumps(rec) + "\n")
                    jf.flush()
                    if sc in LOSS:
                        log(f"  -> restarts a={rec['restarts']['a']} b={rec['restarts']['b']} {rec['restart_worlds']}, "
                            f"W2 at end: {rec['running_world2_at_end']}, measured loss {rec['measured_loss']}, "
                            f"all_reduce/s {rec['allreduce_per_s_clean']} -> {rec['allreduce_per_s_loss']}")
                    else:
                        log(f"  -> restarted {fmt_s(rec['restarted_s'])}, training {fmt_s(rec['training_s'])}")
    finally:
        jf.close()
        sweep_root_rules()
    write_results(records, list(CONFIGS), args)


if __name__ == "__main__":
    main()
