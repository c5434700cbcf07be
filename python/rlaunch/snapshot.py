"""Each step's state in the memory of the node's rlaunch agent, replicated to another node.

``save(step, state)`` hands this rank's ``state`` (a nested structure of tensors, numpy arrays and
small picklable values) to the agent: the agent answers a buffer it owns (a memfd), the tensors'
bytes are written into it once (CUDA tensors copied to host memory on the way), and a commit makes
the agent hold it. The process may die the instant ``save`` returns: the part is the agent's.

``load()`` answers ``(step, state)`` for the step the agent chose for this round (the newest step
whose every rank's part is still held somewhere, the same on every rank) or ``None``. Tensors come
back on the CPU as copy-on-write views of the agent's buffer: nothing is copied until written.
``load(rank=k)`` reads another rank's part of that step (resharding to a new world size); a rank
the saved world did not have gets ``(step, None)``.

Outside rlaunch (``RLAUNCH_SNAPSHOT`` unset) ``save`` returns False and ``load`` None, after one
line on stderr.

``load`` runs no code from the part's bytes (whoever can write a part must not run code in every
rank that loads it): it builds what ``torch.load(weights_only=True)`` builds. Tensors, numpy
arrays and numpy scalars travel as raw bytes; the structure may hold dict, list, tuple, set,
frozenset, ``collections.OrderedDict`` and ``Counter``, int, float, complex, bool, None, str,
bytes, bytearray, ``torch.Size``, ``torch.device``, torch's dtypes, layouts and qschemes. Any
other class or function the structure names is refused (``GlobalNotAllowed``, naming it, before
anything of it runs) unless the program allows it by name: ``load(allow=[MyClass])``,
``load(allow=["mymodule.MyClass"])``, or ``torch.serialization.add_safe_globals([MyClass])``,
which ``load`` honours as ``torch.load`` does. Globals of ``sys``, ``os``, ``posix`` and ``nt`` are
never allowed (as in torch).
"""

import codecs
import collections
import importlib
import io
import json
import mmap
import os
import pickle
import socket
import struct
import sys
import threading

from . import compiled as _compiled

SOCKET_ENV = "RLAUNCH_SNAPSHOT"
_MAGIC = b"RLSNAPPY"
# A part that carries the process's compiled code too (save(..., compiled=True)): after the
# header's length, where those bytes start (from the data's start) and how many there are.
_MAGIC_COMPILED = b"RLSNAPC1"
_ALIGN = 64
# Numpy scalars saved as their bytes: booleans, numbers, dates and durations, bytes and text.
_RAW_SCALAR_KINDS = "biufcmMSU"

_lock = threading.Lock()
_conn = None
_said = False
# The agent hands each rank back the buffer of a step it no longer needs: its mapping is kept
# here (by the memfd's inode), so a save after the first is one copy into mapped memory, with
# no page faults and no system call per page.
_maps = {}
_MAX_MAPS = 4


class SnapshotError(RuntimeError):
    """The agent refused a save or load, or could not be reached, or a part cannot be read."""


class GlobalNotAllowed(SnapshotError):
    """A part's structure names a class or function (``name``, as ``module.qualname``) that
    ``load`` does not allow: nothing of it was run."""

    def __init__(self, message, name):
        super().__init__(message)
        self.name = name


class _Full(Exception):
    """The node's snapshot memory (--snapshot-memory) has no room for this part."""


_said_full = False


def enabled():
    """Whether this process was started by an rlaunch agent that holds snapshots."""
    return bool(os.environ.get(SOCKET_ENV))


def _connection():
    global _conn, _said
    if _conn is not None:
        return _conn
    path = os.environ.get(SOCKET_ENV)
    if not path:
        if not _said:
            _said = True
            print(f"rlaunch.snapshot: not started by rlaunch ({SOCKET_ENV} unset): "
                  "snapshots are neither saved nor loaded", file=sys.stderr, flush=True)
        return None
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
    except OSError as e:
        s.close()
        raise SnapshotError(f"the agent's snapshot socket {path}: {e}") from e
    _conn = s
    return s


def _recv_exact(s, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise SnapshotError("the agent closed the snapshot connection")
        buf += chunk
    return bytes(buf)


def _call(s, req):
    """One request and its answer. Anything that interrupts it (a signal turned into an
    exception, a broken connection) closes the connection: a later request must never read
    this one's answer."""
    global _conn
    try:
        return _call_once(s, req)
    except _Full:
        raise
    except BaseException:
        if _conn is s:
            _conn = None
        try:
            s.close()
        except OSError:
            pass
        raise


def _call_once(s, req):
    body = json.dumps(req).encode()
    s.sendall(struct.pack("<I", len(body)) + body)
    fds = []
    head = b""
    while len(head) < 4:
        data, anc, _flags, _addr = s.recvmsg(4 - len(head), socket.CMSG_SPACE(4 * 4))
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                usable = len(payload) - len(payload) % 4
                fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
        if not data:
            for fd in fds:
                os.close(fd)
            raise SnapshotError("the agent closed the snapshot connection")
        head += data
    (length,) = struct.unpack("<I", head)
    answer = json.loads(_recv_exact(s, length))
    for extra in fds[1:]:
        os.close(extra)
    fd = fds[0] if fds else None
    if not answer.get("ok"):
        if fd is not None:
            os.close(fd)
        if answer.get("full"):
            raise _Full(answer.get("error"))
        raise SnapshotError(f"the agent refused: {answer.get('error')}")
    return answer, fd


def _env_int(name):
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        raise SnapshotError(f"{name} is not set to a number") from None


def _align(n):
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


class _Pickler(pickle.Pickler):
    """Pickles the structure; tensors and arrays become references to byte ranges."""

    def __init__(self, file):
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.arrays = []  # (bytes to write, nbytes, what keeps them alive)
        self.cursor = 0  # where the next array starts, from the data's start
        self._torch = sys.modules.get("torch")
        self._numpy = sys.modules.get("numpy")

    def persistent_id(self, obj):
        torch, np = self._torch, self._numpy
        if torch is not None and isinstance(obj, torch.Tensor):
            t = obj.detach()
            flat = t.reshape(-1).contiguous()  # on its device: copied to host memory once, below
            nbytes = flat.numel() * flat.element_size()
            return ("t", self._place(None, nbytes, flat),
                    str(t.dtype).split(".")[-1], tuple(t.shape), nbytes)
        if np is not None and isinstance(obj, np.ndarray) and not obj.dtype.hasobject:
            a = np.ascontiguousarray(obj)
            return ("n", self._place(a.reshape(-1).view(np.uint8) if a.nbytes else None, a.nbytes, a),
                    a.dtype.str, tuple(a.shape), a.nbytes)
        if (np is not None and isinstance(obj, np.generic) and obj.dtype.kind in _RAW_SCALAR_KINDS
                and obj.dtype.itemsize):
            # A numpy scalar (np.float32(0.5), often in a state) as its bytes: pickled, it would
            # name numpy's reconstruction functions, which load does not run by default.
            a = np.array(obj).reshape(1)
            return ("g", self._place(a.view(np.uint8), a.nbytes, a), a.dtype.str, (), a.nbytes)
        return None

    def _place(self, data, nbytes, keep):
        at = self.cursor
        self.arrays.append((data, nbytes, keep, at))
        self.cursor = _align(at + nbytes)
        return at


def save(step, state, *, compiled=False):
    """Hands this rank's ``state`` for ``step`` to the agent. Returns True once the agent holds
    it; False outside rlaunch, or when the part does not fit in the node's snapshot memory
    (``--snapshot-memory``; said once, training goes on and the last committed step stays).
    Raises SnapshotError when the agent cannot be reached or refuses otherwise.

    ``compiled=True``: the part carries this process's ``torch.compile`` output too (inductor's
    and AOTAutograd's graphs, the kernels they load; see ``rlaunch.compiled``), for a spare or a
    replacement to load with ``load(compiled=True)`` instead of compiling again. Made again only
    after something new was compiled; nothing when the process compiled nothing. It counts
    against the node's snapshot memory with the rest of the part."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, not {step!r}")
    resilient = sys.modules.get(__package__ + ".resilient")
    if resilient is not None and resilient.saves_closed():
        return False  # the round ended (rlaunch.resilient): this step is not the round's
    with _lock:
        s = _connection()
        if s is None:
            return False
        buf = io.BytesIO()
        p = _Pickler(buf)
        p.dump(state)
        header = buf.getvalue()
        code = _compiled.blob() if compiled else None
        if code:
            code_at = p._place(code, len(code), code)
            prefix = _MAGIC_COMPILED + struct.pack("<QQQ", len(header), code_at, len(code))
        else:
            prefix = _MAGIC + struct.pack("<Q", len(header))
        start = _align(len(prefix) + len(header))
        total = start + p.cursor
        rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
        try:
            _, fd = _call(s, {"op": "reserve", "step": step, "rank": rank, "world": world, "len": total})
        except _Full as full:
            global _said_full
            if not _said_full:
                _said_full = True
                print(f"rlaunch.snapshot: {full}", file=sys.stderr, flush=True)
            return False
        if fd is None:
            raise SnapshotError("no buffer came with the reservation")
        try:
            mm = _mapping(fd, total)
        finally:
            os.close(fd)
        _write(mm, 0, prefix + header)
        for arr, nbytes, keep, at in p.arrays:
            if nbytes:
                _copy_into(mm, start + at, arr, nbytes, keep)
        _call(s, {"op": "commit", "step": step, "rank": rank})
        return True


def _mapping(fd, total):
    st = os.fstat(fd)
    key = (st.st_dev, st.st_ino)
    mm = _maps.pop(key, None)
    if mm is not None and len(mm) != total:
        _unmap(mm)
        mm = None
    if mm is None:
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        mm = mmap.mmap(fd, total, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    _maps[key] = mm  # the newest last
    while len(_maps) > _MAX_MAPS:
        _unmap(_maps.pop(next(iter(_maps))))
    return mm


def _unmap(mm):
    try:
        mm.close()
    except BufferError:
        pass  # a view of it is still alive somewhere: it goes with the view


def _write(mm, at, data):
    view = memoryview(data).cast("B")
    mm[at:at + len(view)] = view


def _copy_into(mm, at, arr, nbytes, keep):
    """One copy of an array's bytes into the mapping (CUDA tensors straight to host memory;
    plain bytes, the compiled code, as they are)."""
    if isinstance(keep, bytes):
        _write(mm, at, keep)
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(keep, torch.Tensor):
        dst = torch.frombuffer(mm, dtype=torch.uint8, count=nbytes, offset=at)
        if keep.device.type == "cpu":
            dst.copy_(keep.view(torch.uint8))
        else:
            dst.view(keep.dtype).copy_(keep)
        del dst
        return
    np = sys.modules["numpy"]
    dst = np.frombuffer(mm, dtype=np.uint8, count=nbytes, offset=at)
    dst[:] = arr
    del dst


# What a part's structure may name without the program's leave: the globals torch.load
# (weights_only=True) allows, of those Python's pickle writes for the plain values save keeps in
# the structure (tensors, arrays and numpy scalars are raw bytes, never pickled).
_PLAIN_GLOBALS = {
    "collections.OrderedDict": collections.OrderedDict,
    "collections.Counter": collections.Counter,
    "builtins.set": set,
    "builtins.frozenset": frozenset,
    "builtins.complex": complex,
    "builtins.bytearray": bytearray,
    "_codecs.encode": codecs.encode,  # bytes, as pickle protocol 2 writes them
}
# Never allowed, whatever the program allows (as torch.load's weights_only).
_NEVER = ("sys", "os", "posix", "nt")


def _torch_global(module, name):
    """torch's own value types that torch.load allows: dtypes, qschemes, Size, device, and the
    layouts (by their name). None for anything else."""
    if module != "torch" and (module, name) != ("torch.serialization", "_get_layout"):
        return None
    try:
        import torch
    except ImportError:
        return None
    if module == "torch.serialization":
        return torch.serialization._get_layout
    if name in ("Size", "device"):
        return getattr(torch, name)
    obj = vars(torch).get(name)  # vars: never torch's lazy-import __getattr__
    return obj if isinstance(obj, (torch.dtype, torch.qscheme)) else None


def _never(full):
    return full.partition(".")[0] in _NEVER


def _allowed(allow):
    """``allow`` (and torch's safe globals, when torch is imported) as {"module.qualname": object}.
    Names are resolved here, once, by the program's own imports: what a part's structure names is
    only ever looked up in this table, never imported or traversed."""
    if allow is None:
        allow = ()
    if isinstance(allow, (str, bytes)) or not hasattr(allow, "__iter__"):
        raise TypeError("allow is a list of classes, functions or their 'module.qualname' names, "
                        f"not {allow!r}")
    table = {}

    def add(obj, *names):
        for n in names:
            table[n] = obj

    def canonical(obj):
        module, qualname = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
        return f"{module}.{qualname}" if module and qualname else None

    for entry in allow:
        if isinstance(entry, str):
            obj = _resolve(entry)
            names = [entry, canonical(obj)]
        elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str):
            obj, names = entry[0], [entry[1]]
        elif canonical(entry) is not None:
            obj, names = entry, [canonical(entry)]
        else:
            raise TypeError(f"allow: {entry!r} is neither a class or function nor a 'module.qualname' name")
        for n in names:
            if n and _never(n):
                raise ValueError(f"allow: `{n}` is never allowed: load refuses every global of "
                                 f"{', '.join(_NEVER)}")
        add(obj, *(n for n in names if n))
    torch = sys.modules.get("torch")
    get_safe = getattr(getattr(torch, "serialization", None), "get_safe_globals", None)
    if get_safe is not None:
        for entry in get_safe():
            if isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[1], str):
                obj, name = entry
            else:
                obj, name = entry, canonical(entry)
            if name and not _never(name):
                table.setdefault(name, obj)
    return table


def _resolve(name):
    """The object a ``module.qualname`` name names, imported as the program would import it."""
    parts = name.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                obj = getattr(obj, attr)
        except AttributeError:
            continue
        return obj
    raise ValueError(f"allow: `{name}` names nothing importable (give 'module.qualname', or the object)")


class _Unpickler(pickle.Unpickler):
    """The structure of a part, built by the rules of torch.load(weights_only=True): every class
    or function it names comes from the table of allowed ones (find_class is the one way a pickle
    reaches a callable: REDUCE, NEWOBJ and BUILD only act on what it answered), and its
    persistent ids are checked before they address the part's bytes."""

    def __init__(self, file, mm, start, allowed):
        super().__init__(file)
        self.mm = mm
        self.start = start
        self.allowed = allowed

    def find_class(self, module, name):
        full = f"{module}.{name}"
        if _never(full):
            raise GlobalNotAllowed(full, full)
        obj = _PLAIN_GLOBALS.get(full)
        if obj is None and module.startswith("torch"):
            obj = _torch_global(module, name)
        if obj is None:
            obj = self.allowed.get(full)
        if obj is None:
            raise GlobalNotAllowed(full, full)
        return obj

    def persistent_load(self, pid):
        if type(pid) is not tuple or len(pid) != 5:
            raise SnapshotError(f"an array reference that is not one: {pid!r}")
        kind, at, dtype, shape, nbytes = pid
        if (kind not in ("t", "n", "g") or type(at) is not int or type(nbytes) is not int or at < 0
                or nbytes < 0 or type(dtype) is not str or type(shape) is not tuple
                or any(type(d) is not int or d < 0 for d in shape)):
            raise SnapshotError(f"an array reference that is not one: {pid!r}")
        off = self.start + at
        if off + nbytes > len(self.mm):
            raise SnapshotError("a snapshot part is shorter than its header says")
        if kind == "t":
            import torch

            dt = vars(torch).get(dtype)
            if not isinstance(dt, torch.dtype):
                raise SnapshotError(f"a tensor of an unknown dtype {dtype!r}")
            if nbytes == 0:
                return torch.empty(shape, dtype=dt)
            count = nbytes // torch.empty((), dtype=dt).element_size()
            return torch.frombuffer(self.mm, dtype=dt, count=count, offset=off).view(shape)
        import numpy as np

        dt = np.dtype(dtype)
        if dt.hasobject or dt.itemsize == 0 and nbytes:
            raise SnapshotError(f"an array of dtype {dtype!r}, which raw bytes cannot hold")
        if kind == "g":
            if nbytes != dt.itemsize:
                raise SnapshotError(f"a numpy scalar of {nbytes} bytes for dtype {dtype!r}")
            return np.frombuffer(self.mm, dtype=dt, count=1, offset=off)[0]
        if nbytes == 0:
            return np.empty(shape, dtype=dt)
        return np.frombuffer(self.mm, dtype=dt, count=nbytes // dt.itemsize, offset=off).reshape(shape)


def _uses_extensions(header):
    """Whether the structure names a global by copyreg's extension codes: the C unpickler takes
    those from a process-wide cache, past find_class. Looked for only when a program registered
    extensions (copyreg.add_extension); otherwise an extension code cannot resolve at all."""
    import copyreg

    if not (copyreg._inverted_registry or copyreg._extension_cache):
        return False
    import pickletools

    return any(op.name.startswith("EXT") for op, _, _ in pickletools.genops(header))


def load(rank=None, *, allow=(), compiled=False):
    """``(step, state)`` of the step this round restores, this rank's part (or ``rank``'s), or
    None when there is none, or outside rlaunch. Every rank of a round gets the same step.

    Runs no code from the part: its structure may name only what torch.load(weights_only=True)
    allows (see the top of this module), the classes and functions in ``allow`` (the objects, or
    their ``"module.qualname"`` names: allow only what you trust whoever saved the part with), and
    those given to ``torch.serialization.add_safe_globals``. A part naming anything else raises
    ``GlobalNotAllowed`` (its ``name`` says what), with nothing of it run.

    ``compiled=True``: when the part carries compiled code (``save(..., compiled=True)``) and
    this process has compiled nothing yet (a spare's or a replacement's worker), that code is put
    where ``torch.compile`` finds it first, so the first step loads the survivors' graphs and
    kernels instead of compiling them. That code runs: ask for it only where whoever can save a
    part (the job's own ranks) is trusted to. Parts of another torch version are not used (said
    once)."""
    allowed = _allowed(allow)
    with _lock:
        s = _connection()
        if s is None:
            return None
        if rank is None:
            rank = _env_int("RANK")
        answer, fd = _call(s, {"op": "load", "rank": int(rank)})
        if answer.get("step") is None:
            if fd is not None:
                os.close(fd)
            return None
        if fd is None:
            # A rank the saved world did not have (the world grew): the step, and no part of
            # its own; load(rank=k) for k below the saved world reads the parts to reshard.
            return answer["step"], None
        length = int(answer["len"])
        try:
            mm = mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
    step = answer["step"]
    part = f"rank {rank}'s part of step {step}"
    magic = mm[:8]
    code = None
    if magic == _MAGIC and len(mm) >= 16:
        (hlen,) = struct.unpack("<Q", mm[8:16])
        prefix = 16
    elif magic == _MAGIC_COMPILED and len(mm) >= 32:
        hlen, code_at, code_len = struct.unpack("<QQQ", mm[8:32])
        prefix = 32
        code = (code_at, code_len)
    else:
        raise SnapshotError(f"{part} is not a Python snapshot")
    if prefix + hlen > len(mm):
        raise SnapshotError(f"{part} cannot be read: it is shorter than its header says")
    header = mm[prefix:prefix + hlen]
    start = _align(prefix + hlen)
    if code is not None:
        code_at, code_len = code
        if start + code_at + code_len > len(mm):
            raise SnapshotError(f"{part} cannot be read: its compiled code lies past its end")
    try:
        if _uses_extensions(header):
            raise GlobalNotAllowed("copyreg extension codes", "copyreg extension codes")
        state = _Unpickler(io.BytesIO(header), mm, start, allowed).load()
    except GlobalNotAllowed as e:
        if _never(e.name):
            why = f"which load never allows (no global of {', '.join(_NEVER)} is)"
        else:
            why = ("which load does not allow. By default a part may hold tensors, numpy arrays "
                   "and scalars, plain containers and Python scalars; if you trust whoever saved "
                   f"it, allow more by name: load(allow=[{e.name!r}])")
        raise GlobalNotAllowed(f"{part} needs `{e.name}`, {why}; nothing of it was run", e.name) from None
    except SnapshotError as e:
        raise SnapshotError(f"{part} cannot be read: {e}") from e
    except Exception as e:
        raise SnapshotError(f"{part} cannot be read: {type(e).__name__}: {e}") from e
    if compiled and code is not None and code[1]:
        _compiled.install(memoryview(mm)[start + code[0]:start + code[0] + code[1]])
    return step, state
