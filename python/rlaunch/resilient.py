"""Survivors keep their process: a function that runs again, in the same process, when the job
re-forms.

    import rlaunch

    model = build_model().to(device)          # once per process: imports, the model,
    model = torch.compile(model)              # torch.compile, data loaders, CUDA context
    loader = make_loader()

    @rlaunch.resilient
    def train():
        dist.init_process_group("gloo")       # each round: the group, DDP, the state
        ddp = DDP(model)
        start = 0
        got = rlaunch.snapshot.load()
        if got:
            start, state = got[0] + 1, got[1]
            model.load_state_dict(state["model"])
        for step in range(start, steps):
            ...
            rlaunch.snapshot.save(step, {"model": model.state_dict()})
        dist.destroy_process_group()

    train()

Under rlaunch (an elastic job: a rendezvous endpoint), when the job re-forms because of
something elsewhere (a node lost or joining, a worker failing on another node), a worker whose
every local peer opted in too is not stopped. The agent tells it the round ended; a thread of
this module ends the collective in flight (NCCL: the communicator is aborted; gloo: the
process's connections to the round's hosts are shut down, which is what ends a gloo collective
waiting on a peer that will never answer), the exception that comes out of the function is
taken for the round's end, the default process group is destroyed, and once the next round
closes the environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``,
``TORCHELASTIC_RESTART_COUNT``, ...) is exactly what a fresh worker of that round gets, and the
function runs again. Its state comes back from ``rlaunch.snapshot`` as after any restart.

Outside rlaunch, or when rlaunch cannot keep the process (standalone jobs, a node whose workers
did not all opt in), the function runs once as a plain call, and a failure ends the worker as
it would without the decorator.
"""

import functools
import json
import os
import socket
import sys
import threading

from . import interrupt as _interrupt

CONTROL_ENV = "RLAUNCH_CONTROL"
# How long an exception that looks like a failed collective waits for the agent's word that the
# round ended (a peer's death breaks the collective before the rendezvous has seen it).
WAIT_FOR_WORD_ENV = "RLAUNCH_RESILIENT_WAIT"
WAIT_FOR_WORD_S = 30.0



# How long the agent has to take this worker in (it waits for its worker's pid itself).
WELCOME_WITHIN_S = 10.0


class _Control:
    """The connection to the agent, and what it said."""

    def __init__(self, path, local_rank):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.ended = None  # {"round", "hosts"} once a round ended
        self.resume = None  # {"round", "env"} once the next round closed
        self.closed = False
        self.welcome = False
        self.rounds_ended = 0
        # TCP connections this process had before the function first ran: never the
        # collectives', so never shut down at a round's end (a local service, a data server).
        self.keep_inodes = {inode for _, inode, *_ in _interrupt.tcp_connections()}
        self.abort_thread = None
        self._send({"hello": {"local_rank": local_rank, "pid": os.getpid()}})
        threading.Thread(target=self._read, name="rlaunch-resilient", daemon=True).start()
        with self.lock:
            self.changed.wait_for(lambda: self.welcome or self.closed, WELCOME_WITHIN_S)
            if not self.welcome:
                raise OSError("the agent did not take this worker in")

    def _send(self, msg):
        self.sock.sendall((json.dumps(msg) + "\n").encode())

    def _read(self):
        f = self.sock.makefile("rb")
        try:
            for line in f:
                msg = json.loads(line)
                if "welcome" in msg:
                    with self.lock:
                        self.welcome = True
                        self.changed.notify_all()
                elif "end" in msg:
                    # Saves stop first, under the lock with the end noted (a round beginning
                    # sees both or neither): an aborted NCCL reduction may return garbage,
                    # whose step must not commit. Then the collectives end; the main thread,
                    # woken last, destroys the group only after that (and an NCCL abort) is done.
                    # The NCCL abort is started under the lock too: a main thread that sees the end
                    # always finds the abort to join before it destroys the group.
                    global _saves_closed
                    with self.lock:
                        _saves_closed = True
                        self.abort_thread = _start_nccl_abort()
                        self.ended = msg["end"]
                        self.rounds_ended += 1
                    _interrupt.interrupt_collectives(msg["end"].get("hosts", []), skip_inodes=self.keep_inodes)
                    with self.lock:
                        self.changed.notify_all()
                elif "resume" in msg:
                    with self.lock:
                        self.resume = msg["resume"]
                        self.changed.notify_all()
        except (OSError, ValueError):
            pass
        with self.lock:
            self.closed = True
            self.changed.notify_all()

    def begin_round(self):
        """Opens saves for a run of the function and answers the count of ends so far; None when
        an end was heard since the last resume (the round about to run is over already)."""
        global _saves_closed
        with self.lock:
            if self.ended is not None:
                return None
            _saves_closed = False
            return self.rounds_ended

    def wait_for_end(self, timeout):
        with self.lock:
            self.changed.wait_for(lambda: self.ended is not None or self.closed, timeout)
            return self.ended is not None

    def park(self):
        """Says this worker ended its round; waits for the next. Returns its environment, or
        None when the agent went away (the worker then ends with the round's exception)."""
        with self.lock:
            round_ = self.ended["round"]
        self._send({"parked": {"round": round_}})
        with self.lock:
            self.changed.wait_for(lambda: self.resume is not None or self.closed)
            resume, self.resume = self.resume, None
            # An end that came after the resume is the next round's: kept.
            if self.ended is not None and self.ended.get("round") == round_:
                self.ended = None
        return resume

    def wait_for_abort(self, timeout):
        t = self.abort_thread
        if t is not None:
            t.join(timeout)
            if t.is_alive():
                print(f"rlaunch.resilient: the NCCL abort did not return within {timeout} s", file=sys.stderr)



_control = None
_control_lock = threading.Lock()
# From the word that a round ended until the function runs again: this worker's saves are not
# its round's (rlaunch.snapshot.save answers False).
_saves_closed = False


def saves_closed():
    """Whether the current round ended for this worker and it has not run again yet."""
    return _saves_closed


def _connect():
    """The agent's control connection, made once; None outside rlaunch (or where it fails)."""
    global _control
    with _control_lock:
        if _control is None:
            path = os.environ.get(CONTROL_ENV)
            if not path:
                _control = False
            else:
                try:
                    _control = _Control(path, int(os.environ.get("LOCAL_RANK", "0")))
                except (OSError, ValueError) as e:
                    print(f"rlaunch.resilient: cannot reach the agent ({e}); the function runs once", file=sys.stderr)
                    _control = False
        return _control or None


def _start_nccl_abort():
    """Starts aborting NCCL's communicators, on a thread of its own (returned, or None without an
    NCCL group), so that an abort that blocks never stops the control thread from hearing the
    next round. The TCP connections to the round's hosts (gloo's, and a store a group being made
    waits on) are shut down by the caller (rlaunch.interrupt); with no hosts (the round's members
    unknown), every connection made since the function first ran."""
    dist = sys.modules.get("torch.distributed")
    backend = ""
    try:
        if dist is not None and dist.is_initialized():
            backend = str(dist.get_backend()).lower()
    except Exception:  # noqa: BLE001 - a group half made or half gone
        backend = ""
    if "nccl" not in backend:
        return None

    def abort():
        try:
            dist.distributed_c10d._abort_process_group()
        except Exception as e:  # noqa: BLE001
            print(f"rlaunch.resilient: aborting NCCL failed: {e!r}", file=sys.stderr)

    aborting = threading.Thread(target=abort, name="rlaunch-resilient-abort", daemon=True)
    aborting.start()
    return aborting


def _looks_like_a_collective(e):
    """Whether an exception is what a collective raises when a peer is gone."""
    dist = sys.modules.get("torch.distributed")
    dist_error = getattr(dist, "DistError", None) if dist else None
    if dist_error is not None and isinstance(e, dist_error):
        return True
    text = f"{type(e).__name__}: {e}".lower()
    return isinstance(e, RuntimeError) and any(
        w in text for w in ("gloo", "nccl", "connection", "peer", "timed out", "socket", "broken pipe")
    )


def _destroy_group():
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as e:  # noqa: BLE001 - a broken group still goes
        print(f"rlaunch.resilient: destroying the process group: {e!r}", file=sys.stderr)
    finally:
        # torch names a group before making it, advancing its group counter; a group whose
        # making failed (the round ended while it waited on a peer) leaves it advanced, and
        # destroy_process_group may fail before resetting it. A fresh worker of the next round
        # starts from 0, and the groups' names (their store prefixes) must agree.
        world = getattr(getattr(dist, "distributed_c10d", None), "_world", None)
        if world is not None and getattr(world, "group_count", 0):
            world.group_count = 0


def resilient(fn):
    """Runs ``fn`` again in the same process each time the job re-forms (see the module)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        ctl = _connect()
        if ctl is None:
            return fn(*args, **kwargs)
        # The agent took this worker in. torch's NCCL watchdog must leave a failed communicator
        # to this module: with its default (tear the process down) a peer's death kills the
        # survivor, and its abort racing this module's hung a survivor on an H200
        # (bench/gpu/README.md). Read when a process group is made, in the function; a user's
        # own setting is kept.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "0")
        while True:
            seen = ctl.begin_round()
            if seen is None:
                # Ended before it ran: park again (the agent gone: the job is ending).
                ctl.wait_for_abort(timeout=10)
                _destroy_group()
                resume = ctl.park()
                if resume is None:
                    raise RuntimeError("rlaunch.resilient: the agent went away while this worker was parked")
                os.environ.update(resume["env"])
                continue
            try:
                return fn(*args, **kwargs)
            except (KeyboardInterrupt, SystemExit):
                raise  # the operator's or the program's own: never a round's end
            except BaseException as e:  # noqa: BLE001 - decided below, re-raised if not ours
                if ctl.rounds_ended == seen:
                    if not _looks_like_a_collective(e):
                        raise
                    wait = float(os.environ.get(WAIT_FOR_WORD_ENV, WAIT_FOR_WORD_S))
                    if not ctl.wait_for_end(wait):
                        raise
                failure = e
            ctl.wait_for_abort(timeout=10)
            _destroy_group()
            resume = ctl.park()
            if resume is None:
                raise failure
            os.environ.update(resume["env"])

    return run
