"""A survivor keeps its process on NCCL: one rank of a two-rank NCCL group loses its peer in the
middle of a step, aborts the communicator while its all-reduce waits, makes a new process group
and trains on, in the same process (CUDA context, compiled model and optimizer state kept).

Both ranks share the one GPU of the test machine: each has an NCCL_HOSTID of its own, so NCCL
takes them for two hosts and connects them over its socket transport (loopback). This script
plays the agent: it starts the ranks, sees the peer die (or stop), tells the survivor that the
round ended (a TCPStore key its watcher thread waits on), and starts a replacement, a cold
process, which joins the new group and receives the survivor's state.

Scenarios, each with fresh processes:
  baseline  no fault: the parameters every two-rank scenario must end with, bit for bit
  default   the peer SIGKILLed mid-step, torch's default TORCH_NCCL_ASYNC_ERROR_HANDLING: does
            the survivor's process live until it is told?
  killed    the peer SIGKILLed mid-step, TORCH_NCCL_ASYNC_ERROR_HANDLING=0 (torch's watchdog
            leaves the communicator to the survivor): abort, re-form with a replacement, train on
  stopped   the peer SIGSTOPped mid-step (silent: no connection closes, as in a partition)
  alone     the peer SIGKILLed; the survivor goes on alone (world 1) with its model under
            torch.compile: the step after the abort against a cold process's first step
  killed-h2 as killed, with TORCH_NCCL_ASYNC_ERROR_HANDLING=2 (the watchdog aborts the
            communicator as well, after dumping its debug information)

A process still running at a scenario's deadline is sent SIGUSR1 first: every thread's Python
stack goes to the scenario's log (faulthandler), then it is killed.

    python3 bench/gpu/nccl_survivor.py --out REPORT.md --logs DIR      (on a GPU)
    GPU_PATHS_DRY=1 python3 bench/gpu/nccl_survivor.py ...             (CPU, gloo: the harness)

In the dry run the collective is ended by rlaunch.interrupt (gloo has no working abort).
Appends a section to REPORT.md; exit 0 when every check passed.
"""

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from datetime import timedelta

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
DRY = os.environ.get("GPU_PATHS_DRY") == "1"
PY = sys.executable
SCENARIOS = ["baseline", "killed", "stopped", "alone", "killed-h2", "default"]
# What each scenario sets of torch's NCCL error handling. 0: torch's watchdog leaves a failed
# communicator alone (the survivor aborts it itself, once); 2: the watchdog aborts it too, and
# dumps its debug information first; absent: torch's default (3: tear the process down).
HANDLING = {"baseline": "0", "killed": "0", "stopped": "0", "alone": "0", "killed-h2": "2", "default": None}


# ---- the worker -----------------------------------------------------------------------------


def worker(a):
    t_spawn = a.spawned
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    t_import = time.time()
    dev = torch.device("cpu") if DRY else torch.device("cuda", 0)
    if not DRY:
        torch.cuda.set_device(dev)
        torch.zeros(1, device=dev)
    t_cuda = time.time()
    backend = "gloo" if DRY else "nccl"
    store = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=120))
    rec = {"rank": a.rank, "gen": a.gen, "pid": os.getpid(), "t_spawn": t_spawn, "t_import": t_import,
           "t_cuda": t_cuda, "handling": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "(torch default)")}

    def save():
        with open(os.path.join(a.dir, f"{a.scenario}.r{a.rank}.g{a.gen}.json"), "w") as f:
            json.dump(rec, f)

    torch.manual_seed(7)
    dims = [a.dim, a.hidden, a.hidden, 8]
    params = []
    for i in range(len(dims) - 1):
        params += [(torch.randn(dims[i + 1], dims[i]) / dims[i] ** 0.5).to(dev).requires_grad_(),
                   torch.zeros(dims[i + 1], device=dev, requires_grad=True)]
    moms = [torch.zeros_like(p) for p in params]

    def forward(x):
        h = x
        for i in range(0, len(params), 2):
            h = torch.nn.functional.linear(h, params[i], params[i + 1])
            if i + 2 < len(params):
                h = torch.relu(h)
        return h

    fwd = torch.compile(forward) if a.compile else forward
    centres = torch.randn(8, a.dim, generator=torch.Generator().manual_seed(0)).to(dev)

    def batch(step, part, parts):
        g = torch.Generator().manual_seed(step)
        y = torch.randint(0, 8, (a.batch,), generator=g)
        x = centres.cpu()[y] + torch.randn(a.batch, a.dim, generator=g)
        n = a.batch // parts
        return x[part * n:(part + 1) * n].to(dev), y[part * n:(part + 1) * n].to(dev)

    ended = threading.Event()
    told = {}

    def form(gen, rank, world):
        kw = {} if DRY else {"device_id": dev}
        dist.init_process_group(backend, store=dist.PrefixStore(f"gen{gen}/", store), rank=rank,
                                world_size=world, timeout=timedelta(seconds=60), **kw)

    def abort():
        """Ends the collective in flight: NCCL's communicator aborted (or, dry, gloo's
        connections shut down); returns how."""
        if DRY:
            sys.path.insert(0, os.path.join(ROOT, "python"))
            from rlaunch.interrupt import interrupt_collectives
            n = interrupt_collectives(["127.0.0.1"], keep_ports=[a.port])
            return f"rlaunch.interrupt ({n} connections)"
        errs = []
        if hasattr(c10d, "_abort_process_group"):
            try:
                c10d._abort_process_group()
                return "torch.distributed.distributed_c10d._abort_process_group()"
            except Exception as e:  # noqa: BLE001 - the next way is tried, the error reported
                errs.append(f"_abort_process_group: {e!r}")
        try:
            c10d._get_default_group()._get_backend(dev).abort()
            return "ProcessGroupNCCL.abort()"
        except Exception as e:  # noqa: BLE001
            errs.append(f"backend abort: {e!r}")
        raise RuntimeError("; ".join(errs))

    def watcher():
        """The agent's word that the round ended: store key end0 = the new world size."""
        w = dist.TCPStore("127.0.0.1", a.port, is_master=False, timeout=timedelta(seconds=600))
        try:
            w.wait(["end0"])
        except Exception:  # noqa: BLE001 - the parent ended the scenario
            return
        told["world"] = int(w.get("end0"))
        rec["t_notice"] = time.time()
        ended.set()
        save()
        try:
            rec["abort_how"] = abort()
        except Exception as e:  # noqa: BLE001
            rec["abort_error"] = repr(e)
        rec["t_aborted"] = time.time()
        save()

    gen, world = a.gen, a.world
    form(gen, a.rank, world)
    rec["t_pg"] = time.time()
    save()
    if a.gen > 0:
        # A replacement: the survivor's state arrives by broadcast from rank 0.
        with torch.no_grad():
            for t in params + moms:
                dist.broadcast(t, 0)
        if not DRY:
            torch.cuda.synchronize()
        rec["t_ready"] = time.time()
    elif a.rank == 0 and a.scenario != "baseline":
        threading.Thread(target=watcher, daemon=True).start()

    step = a.start
    first = True
    while step < a.steps:
        # Each rank keeps its share of the step's batch whatever the world: the compiled model
        # sees the same shapes after a re-form (no recompile), and a replacement's steps are
        # the lost rank's.
        x, y = batch(step, a.rank, a.world)
        loss = torch.nn.functional.cross_entropy(fwd(x), y)
        grads = torch.autograd.grad(loss, params)
        if first:
            if not DRY:
                torch.cuda.synchronize()
            rec["t_first_step"] = time.time()
            first = False
        if a.gen == 0 and a.rank == 1 and step == a.fault_step and a.scenario != "baseline":
            rec["fault_step"] = step
            save()
            if a.scenario == "stopped":
                store.set("stopping", "1")
                os.kill(os.getpid(), signal.SIGSTOP)
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        flat = torch.cat([g.flatten() for g in grads])
        failed = None
        t_enter = time.time()
        try:
            work = dist.all_reduce(flat, async_op=True)
            work.wait()
            total = flat.sum().item()  # the host waits here for the reduction
        except Exception as e:  # noqa: BLE001 - an aborted collective may raise
            failed = repr(e)[:300]
            # A collective that fails on its own (the peer's connection closed) comes before
            # the agent's word that the round ended, which decides: wait for it, bounded.
            ended.wait(timeout=10)
        if ended.is_set() and "t_reformed" not in rec:
            # The round ended while this step's all-reduce waited: a new group, the step again.
            rec["t_unblocked"] = time.time()
            rec["step_interrupted"] = step
            rec["blocked_s"] = rec["t_unblocked"] - t_enter
            rec["collective_error"] = failed
            save()
            while "t_aborted" not in rec:
                time.sleep(0.001)
            try:
                dist.destroy_process_group()
            except Exception as e:  # noqa: BLE001
                rec["destroy_error"] = repr(e)[:300]
            rec["t_destroyed"] = time.time()
            gen, world = 1, told["world"]
            form(gen, 0, world)
            rec["t_pg_again"] = time.time()
            if world > 1:
                with torch.no_grad():
                    for t in params + moms:
                        dist.broadcast(t, 0)
            rec["t_reformed"] = time.time()
            save()
            continue
        if failed:
            raise RuntimeError(f"all-reduce failed in step {step} with no word of a new round: {failed}")
        with torch.no_grad():
            flat /= world
            off = 0
            for p, m in zip(params, moms):
                n = p.numel()
                m.mul_(0.9).add_(flat[off:off + n].view_as(p))
                p.sub_(a.lr * m)
                off += n
        if "t_reformed" in rec and "t_next_step" not in rec:
            if not DRY:
                torch.cuda.synchronize()
            rec["t_next_step"] = time.time()
        rec["last_loss"] = loss.item()
        rec.setdefault("first_loss", rec["last_loss"])
        step += 1
    if not DRY:
        torch.cuda.synchronize()
    rec["t_end"] = time.time()
    rec["steps_end"] = step
    rec["digest"] = hashlib.sha256(b"".join(p.detach().cpu().numpy().tobytes() for p in params)).hexdigest()
    rec["world_end"] = world
    rec["cuda_initialised_once"] = DRY or torch.cuda.is_initialized()
    save()
    dist.destroy_process_group()


# ---- the parent (the agent's part) ----------------------------------------------------------


def spawn(a, scenario, d, port, rank, gen, world, start, log, env_extra, compile_):
    env = dict(os.environ)
    env.update(env_extra)
    env["NCCL_HOSTID"] = f"survivor-{scenario}-rank{rank}-gen{gen}"
    env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    env.setdefault("NCCL_IB_DISABLE", "1")
    cmd = [PY, os.path.abspath(__file__), "worker", "--scenario", scenario, "--dir", d, "--port", str(port),
           "--rank", str(rank), "--gen", str(gen), "--world", str(world), "--start", str(start),
           "--steps", str(a.steps), "--fault-step", str(a.fault_step), "--spawned", repr(time.time()),
           "--dim", str(a.dim), "--hidden", str(a.hidden), "--batch", str(a.batch)] + (["--compile"] if compile_ else [])
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def scenario(a, name, d):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    port = store.port
    env = {}
    if HANDLING.get(name) is not None:
        env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = HANDLING[name]
    compile_ = name == "alone"
    log = open(os.path.join(a.logs, f"survivor-{name}.txt"), "w")
    procs = [spawn(a, name, d, port, r, 0, 2, 0, log, env, compile_) for r in range(2)]
    deadline = time.time() + a.timeout
    out = {"name": name, "events": {}}
    ev = out["events"]
    try:
        if name != "baseline":
            # The agent's part: see the peer go, say the round ended, start a replacement.
            if name == "stopped":
                while time.time() < deadline and not store.check(["stopping"]):
                    time.sleep(0.002)
                time.sleep(0.05)  # let the signal land
                ev["t_fault_seen"] = time.time()
            else:
                while time.time() < deadline and procs[1].poll() is None:
                    time.sleep(0.002)
                ev["t_fault_seen"] = time.time()
                ev["peer_exit"] = procs[1].returncode
            new_world = 1 if name == "alone" else 2
            store.set("end0", str(new_world))
            ev["t_told"] = time.time()
            if name == "stopped":
                procs[1].send_signal(signal.SIGKILL)
                procs[1].wait()
            if new_world == 2:
                rec1 = wait_json(d, name, 1, 0, deadline)
                start = rec1.get("fault_step", a.fault_step) if rec1 else a.fault_step
                procs.append(spawn(a, name, d, port, 1, 1, 2, start, log, env, False))
                ev["t_replacement_spawned"] = time.time()
        for p in procs:
            left = deadline - time.time()
            try:
                p.wait(timeout=max(left, 0.1))
            except subprocess.TimeoutExpired:
                out["timed_out"] = True
        out["exits"] = [p.returncode for p in procs]
    finally:
        alive = [p for p in procs if p.poll() is None]
        for p in alive:
            p.send_signal(signal.SIGUSR1)  # every thread's stack into the log
        time.sleep(1 if alive else 0)
        for p in alive:
            p.kill()
            p.wait()
        log.close()
    return out


def wait_json(d, name, rank, gen, deadline):
    path = os.path.join(d, f"{name}.r{rank}.g{gen}.json")
    while time.time() < deadline:
        if os.path.exists(path):
            try:
                return json.load(open(path))
            except ValueError:
                pass
        time.sleep(0.01)
    return None


def read(d, name, rank, gen):
    path = os.path.join(d, f"{name}.r{rank}.g{gen}.json")
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return None


def parent(a):
    import tempfile

    d = tempfile.mkdtemp(prefix="nccl-survivor-")
    os.makedirs(a.logs, exist_ok=True)
    failures = []
    lines = []
    w = lines.append
    w("\n## Survivors keep their process on NCCL (bench/gpu/nccl_survivor.py)\n\n")
    w(f"Two ranks on the one GPU, each with an NCCL_HOSTID of its own (NCCL's socket transport on "
      f"loopback), an MLP {a.dim}-{a.hidden}-{a.hidden}-8, batch {a.batch} split between the ranks, "
      f"{a.steps} steps, the fault in step {a.fault_step} after the peer's backward pass: the "
      f"survivor is in its all-reduce, waiting. The script plays the agent (sees the peer go, says "
      f"the round ended, starts a replacement).{' DRY RUN: CPU, gloo.' if DRY else ''}\n\n")
    results = {}
    for name in a.scenarios:
        t0 = time.time()
        results[name] = scenario(a, name, d)
        print(f"nccl_survivor: {name} took {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    base = read(d, "baseline", 0, 0)
    w("| scenario | survivor lived | same process | abort | blocked in the all-reduce, ms | told → collective returned, ms | told → new group, ms | told → next step, ms | replacement: start → ready, s | final parameters |\n")
    w("|---|---|---|---|---|---|---|---|---|---|\n")
    ms = lambda s: f"{s * 1e3:.0f}" if s is not None else "-"
    for name in a.scenarios:
        r = results[name]
        s = read(d, name, 0, 0)
        rep = read(d, name, 1, 1)
        ev = r["events"]
        handling = HANDLING.get(name) or "torch's default"
        if name == "baseline":
            ok = s is not None and r["exits"] == [0, 0] and s.get("steps_end") == a.steps
            w(f"| baseline | {'yes' if ok else 'NO'} | - | - | - | - | - | - | - | {s['digest'][:12] if s else '-'} |\n")
            if not ok:
                failures.append("baseline did not finish")
            continue
        lived = s is not None and "digest" in s and r["exits"][0] == 0
        if not lived and s is not None:
            # How far it got: the last milestone it recorded.
            marks = [k for k in ("t_pg", "t_notice", "t_aborted", "t_unblocked", "t_destroyed", "t_pg_again",
                                 "t_reformed", "t_next_step") if k in s]
            out_note = f"last milestone {marks[-1] if marks else 'none'}"
            r["exits"][0] = f"{r['exits'][0]}, {out_note}"
        told = ev.get("t_told")
        g = (lambda k: (s[k] - told) if s and k in s and told else None)
        same = "yes (pid %d)" % s["pid"] if lived else "-"
        if lived and name != "alone":
            match = base is not None and rep is not None and s["digest"] == base["digest"] == rep.get("digest")
            final = "equal to baseline, both ranks" if match else "DIFFERENT"
        elif lived:
            final = f"loss {s.get('first_loss', 0):.3f} → {s.get('last_loss', 0):.3f}"
            match = s.get("last_loss", 9) < s.get("first_loss", 0)
        else:
            final, match = "-", False
        startup = (rep["t_ready"] - rep["t_spawn"]) if rep and "t_ready" in rep else None
        w(f"| {name} (handling {handling}) | {'yes' if lived else 'NO: exit %s' % r['exits'][0]} | {same} "
          f"| {s.get('abort_how', s.get('abort_error', '-')) if s else '-'} | {ms(s.get('blocked_s')) if s else '-'} "
          f"| {ms(g('t_unblocked'))} | {ms(g('t_reformed'))} | {ms(g('t_next_step'))} "
          f"| {f'{startup:.2f}' if startup else '-'} | {final} |\n")
        if name in ("default", "killed-h2"):
            continue  # what torch's default does is reported, not required
        if not (lived and match and s.get("t_next_step")):
            failures.append(f"{name}: survivor lived {lived}, result {final}")
    alone = read(d, "alone", 0, 0)
    if alone and "t_first_step" in alone and "t_next_step" in alone and "t_told" in results["alone"]["events"]:
        cold = alone["t_first_step"] - alone["t_spawn"]
        warm = alone["t_next_step"] - results["alone"]["events"]["t_told"]
        w(f"\nThe cost a survivor does not pay again: its own cold start, from the process's start to its "
          f"first step with the model under torch.compile, took {cold:.2f} s (import {alone['t_import'] - alone['t_spawn']:.2f} s, "
          f"CUDA {alone['t_cuda'] - alone['t_import']:.2f} s, the group {alone['t_pg'] - alone['t_cuda']:.2f} s, "
          f"compile and first step {alone['t_first_step'] - alone['t_pg']:.2f} s); after the abort its next step "
          f"came {warm * 1e3:.0f} ms after the word that the round ended ({cold / max(warm, 1e-9):.0f}× less).\n")
    for name in a.scenarios:
        s = read(d, name, 0, 0)
        if s and s.get("collective_error"):
            w(f"\n{name}: the aborted all-reduce raised `{s['collective_error'][:200]}`\n")
    w(f"\nRaw records: {json.dumps({n: results[n] for n in a.scenarios}, default=str)[:3000]}\n")
    w(f"\n**{'pass' if not failures else 'FAIL: ' + '; '.join(failures)}**\n")
    text = "".join(lines)
    print(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write(text)
    return 0 if not failures else 1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", nargs="?", default="parent", choices=["parent", "worker"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--logs", default="/tmp/nccl-survivor-logs")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--timeout", type=float, default=30)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--fault-step", type=int, default=30)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=0.05)
    # worker
    ap.add_argument("--scenario")
    ap.add_argument("--dir")
    ap.add_argument("--port", type=int)
    ap.add_argument("--rank", type=int)
    ap.add_argument("--gen", type=int, default=0)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--start", type=int, default=0)
    ap.add_argument("--spawned", type=float, default=0.0)
    ap.add_argument("--compile", action="store_true")
    a = ap.parse_args()
    if a.mode == "worker":
        worker(a)
        return 0
    a.scenarios = [s for s in a.scenarios.split(",") if s]
    if any(s != "baseline" for s in a.scenarios) and "baseline" not in a.scenarios:
        a.scenarios.insert(0, "baseline")
    return parent(a)


if __name__ == "__main__":
    sys.exit(main())
