"""The process's ``torch.compile`` output as bytes that travel with a snapshot part, and back into a
process that has compiled nothing yet: ``rlaunch.snapshot.save(..., compiled=True)`` and
``rlaunch.snapshot.load(..., compiled=True)``.

A spare or a replacement worker otherwise compiles the model again at its first step, with the
survivors waiting for it in that step's all-reduce; on a host whose inductor cache is cold that
is many seconds (the survivor benchmark's spare: 16.9 s against 3.9 s with a warm cache).

What travels:

- ``torch.compiler.save_cache_artifacts()``: inductor's FX graphs, AOTAutograd's graphs, Triton's
  kernels on a GPU (torch bundles them into the graphs), dynamo's own entries when the program
  runs with ``TORCH_CACHING_PRECOMPILE=1``.
- On the CPU, the C++ kernels those graphs load. Inductor compiles them on each host and torch's
  artifacts do not hold them; they are the shared objects of inductor's in-process code caches,
  named in its cache directory by a hash of their source and compiler command, so a kernel
  handed over is used only where the same source would be compiled the same way.
- On the CPU, the small programs inductor compiles once per cache directory to learn which
  vector instructions the CPU has (6 of them, 5.5 s of a cold first step here). Only the
  compiled probes travel, never their verdict: inductor on the new host loads each and checks
  its own CPU's features itself.
- The artifacts this process was handed itself: torch records an artifact when it writes a cache
  entry, not when it hits one, so a replacement hands on what it got.

Nothing is installed unless the two hosts would compile the same code the same way: inductor's
file names hash the compiler command, which says ``-march=native`` on every CPU, and its graphs
are written for the vector width it picked (an AVX-512 graph compiled for AVX2 computes half
its lanes, silently). So the machines must be the same and, where the code holds C++, the CPU's
features (``/proc/cpuinfo``; unknown is a mismatch, and what ``-march=native`` means to the
compiler), ``ATEN_CPU_CAPABILITY``, ``simdlen`` and the C++ compiler (its ``-v``); and once the
probes are in place the vector instruction set inductor picks here must be the saver's. Any
difference: nothing installed, said once, the process compiles as without. Code that holds no
C++ (a GPU's Triton kernels) needs only the same machine, and no compiler.

The kernels this process writes (or finds written whole, with the same bytes, by another rank
of the host) are also entered in inductor's in-process code caches under the key they were
compiled for: inductor builds its precompiled header (158 MB, 5 s here) for any
kernel that is not there, before it looks whether the kernel's file exists, which on a new host
would cost more than the kernels saved. Any other file at a kernel's name is left to inductor. Torch's artifacts are loaded before any kernel is written or entered.

Loaded only into a process that has compiled no graph yet, once: survivors keep what they have.
The bytes are code. ``load(compiled=True)`` runs what a rank of the job compiled, which is why it
is asked for by name and never done by ``load`` alone.

Layout (little-endian): ``RLCOMP03``, a u32 length, that many bytes of JSON ``{"torch": version,
"host": {what must be equal}, "isa": the vector instruction set or "", "artifacts": [n, ...],
"probes": [[path, n], ...], "files": [[path, n, code cache], ...]}``, then each of torch's
artifacts' bytes, each probe's and each file's, in order.
"""

import glob
import json
import os
import platform
import re
import struct
import sys
import tempfile
import threading

_MAGIC = b"RLCOMP03"
# A kernel's path in inductor's cache directory: two characters of its hash, then the hash.
_FILE = re.compile(r"([a-z0-9_]{2})/([A-Za-z0-9_]{8,128})(\.main)?\.so")

_lock = threading.Lock()
_last = None  # (what it was made from, the bytes)
_host = None
_installed = False
_received = []  # torch's artifacts this process installed, handed on with its own
_said = set()


def _say_once(what, line):
    if what not in _said:
        _said.add(what)
        print(f"rlaunch.snapshot: {line}", file=sys.stderr, flush=True)


def _valid_name(rel):
    m = _FILE.fullmatch(rel)
    return bool(m) and m.group(1) == m.group(2)[1:3]


# Inductor's in-process caches of compiled C++ (a key: a function that loads its library).
_CODE_CACHES = ("CppCodeCache", "CppPythonBindingsCodeCache", "CppWrapperCodeCache")


def _kernel_keys(codecache):
    """{key: the name of the code cache that holds it}."""
    keys = {}
    for name in _CODE_CACHES:
        for key in getattr(getattr(codecache, name, None), "cache", {}) or {}:
            keys.setdefault(key, name)
    return keys


def _cpu_flags():
    """The CPU's features as the kernel lists them (the first processor's), or [] if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip().lower() in ("flags", "features"):
                    return sorted(set(value.split()))
    except OSError:
        pass
    return []


def _native_target(compiler):
    """What ``-march=native`` means to the compiler on this CPU (its target options, enabled or
    not), hashed: the CPU's features as the compiler, not the kernel, sees them."""
    import hashlib
    import subprocess

    out = subprocess.run([compiler, "-march=native", "-Q", "--help=target"], capture_output=True,
                         timeout=30, check=True, env=dict(os.environ, LC_ALL="C")).stdout
    return hashlib.sha256(out).hexdigest()


def _host_facts(cpu_code):
    """What must be the same on the saver's host and the loader's for its code to be used here:
    the machine, and for code that holds C++ the CPU's features (the kernel's list and the
    compiler's ``-march=native``), ``ATEN_CPU_CAPABILITY``, ``simdlen`` and the compiler."""
    global _host
    facts = {"machine": platform.machine()}
    if not cpu_code:
        return facts
    if _host is None:
        from torch._inductor import config
        from torch._inductor.cpp_builder import get_compiler_version_info, get_cpp_compiler

        compiler = get_cpp_compiler()
        _host = {"cpu": _cpu_flags(), "capability": os.environ.get("ATEN_CPU_CAPABILITY", ""),
                 "simdlen": config.cpp.simdlen, "compiler": get_compiler_version_info(compiler),
                 "native": _native_target(compiler)}
    return {**facts, **_host}


def _compiled_anything():
    """Whether this process compiled (or loaded) any graph or kernel: dynamo's count, inductor's
    code caches, torch's record of cache artifacts (a count the program can clear is not enough)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None and utils.counters["stats"].get("unique_graphs", 0):
        return True
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None and _kernel_keys(codecache):
        return True
    cache = sys.modules.get("torch.compiler._cache")
    return bool(cache is not None and getattr(cache.CacheArtifactManager, "_seen_artifacts", None))


def blob():
    """This process's compile output as one ``bytes``, or None when it compiled nothing (or it
    cannot be read: said once). Made again only when something new was compiled since the last
    call: otherwise the same bytes."""
    if not _compiled_anything():
        return None
    try:
        with _lock:
            return _make()
    except Exception as e:
        _say_once("blob", f"the compiled code is not saved with the snapshot: {type(e).__name__}: {e}")
        return None


def _make():
    global _last
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor import codecache
    from torch.compiler._cache import CacheArtifactManager

    keys = _kernel_keys(codecache)
    made_from = (frozenset(keys.items()), counters["stats"].get("unique_graphs", 0),
                 len(getattr(CacheArtifactManager, "_seen_artifacts", ())), len(_received))
    if _last is not None and _last[0] == made_from and not CacheArtifactManager.need_serialize():
        return _last[1]
    saved = torch.compiler.save_cache_artifacts()
    # Torch records an artifact when it writes a cache entry, not when it hits one: a process
    # that was handed its graphs hands them on as it got them, beside what it compiled itself.
    artifacts = list(_received) + ([saved[0]] if saved else [])
    root = codecache.cache_dir()
    # Inductor links each key's library as `<key>.main.so` beside its `<key>.main.cpp`.
    kernels = {f"{key[1:3]}/{key}.main.so": cache for key, cache in keys.items()}
    # The CPU probes: the kernels whose loading inductor marked as having worked on this CPU.
    probes = {os.path.relpath(marker[:-len(".load_ok")], root): ""
              for marker in glob.glob(os.path.join(glob.escape(root), "*", "*.so.load_ok"))}
    # Graphs of C++ code (the kernels they load are in the code caches) were written for the
    # vector instructions inductor picked here: the loader must pick the same.
    isa = ""
    if keys:
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = str(pick_vec_isa())
    complete = True

    def read(names):
        nonlocal complete
        got = []
        for rel, cache in sorted(names.items()):
            if not _valid_name(rel):
                continue
            try:
                with open(os.path.join(root, rel), "rb") as f:
                    got.append((rel, f.read(), cache))
            except FileNotFoundError:
                complete = complete and cache == ""  # a probe gone is no loss
        return got

    probes = read({rel: c for rel, c in probes.items() if rel not in kernels})
    kernels = read(kernels)
    head = json.dumps({"torch": torch.__version__, "host": _host_facts(bool(keys)), "isa": isa,
                       "artifacts": [len(a) for a in artifacts],
                       "probes": [[rel, len(data)] for rel, data, _ in probes],
                       "files": [[rel, len(data), cache] for rel, data, cache in kernels]}).encode()
    out = b"".join([_MAGIC, struct.pack("<I", len(head)), head] + artifacts
                   + [d for _, d, _ in probes] + [d for _, d, _ in kernels])
    # A kernel whose file was missing is looked for again at the next save.
    _last = (made_from, out) if complete else None
    return out


def _parse(data):
    """The header and the bytes of a blob, or raises ValueError naming why."""
    data = memoryview(data)
    if len(data) < 12 or bytes(data[:8]) != _MAGIC:
        raise ValueError("not rlaunch's compiled bytes (or another rlaunch version's)")
    (hlen,) = struct.unpack("<I", data[8:12])
    if 12 + hlen > len(data):
        raise ValueError("shorter than its header says")
    try:
        head = json.loads(bytes(data[12:12 + hlen]))
    except (ValueError, RecursionError):
        raise ValueError("its header is not JSON") from None
    if not isinstance(head, dict):
        raise ValueError("its header is not an object")
    version, sizes, host, isa = head.get("torch"), head.get("artifacts"), head.get("host"), head.get("isa")

    def listing(entries, caches):
        return isinstance(entries, list) and all(
            isinstance(e, list) and len(e) == 2 + bool(caches) and isinstance(e[0], str) and type(e[1]) is int
            and e[1] >= 0 and (not caches or e[2] in caches) for e in entries)

    probes, files = head.get("probes"), head.get("files")
    if (not isinstance(version, str) or not isinstance(sizes, list)
            or not all(type(n) is int and n >= 0 for n in sizes) or not isinstance(host, dict)
            or not isinstance(isa, str) or not listing(probes, ()) or not listing(files, _CODE_CACHES)):
        raise ValueError("its header is not rlaunch's")
    for rel, *_ in probes + files:
        if not _valid_name(rel):
            raise ValueError(f"it names a file {rel!r} that is not a kernel of inductor's cache")
    at = 12 + hlen
    if at + sum(sizes) + sum(e[1] for e in probes + files) != len(data):
        raise ValueError("its length is not what its header says")
    artifacts = []
    for n in sizes:
        artifacts.append(bytes(data[at:at + n]))
        at += n

    def take(entries):
        nonlocal at
        out = []
        for rel, size, *cache in entries:
            out.append((rel, bytes(data[at:at + size]), cache[0] if cache else ""))
            at += size
        return out

    return {"torch": version, "host": host, "isa": isa, "artifacts": artifacts,
            "probes": take(probes), "files": take(files)}


def install(data):
    """Puts a blob's compile output where this process's ``torch.compile`` looks first. Does
    nothing in a process that already compiled or installed anything. Returns whether it
    installed; says once on stderr why not when the blob cannot be used, and never raises."""
    with _lock:
        if _installed or _compiled_anything():
            return False
        try:
            return _install(data)
        except Exception as e:
            _say_once("error", f"the compiled code that came with the snapshot is not used: "
                      f"{type(e).__name__}: {e}")
            return False


def _not_used(what, why):
    _say_once(what, f"the compiled code that came with the snapshot is not used: {why}")
    return False


def _install(data):
    global _installed
    try:
        got = _parse(data)
    except ValueError as e:
        return _not_used("bad", e)
    import torch

    if got["torch"] != torch.__version__:
        return _not_used("version", f"it is torch {got['torch']}'s, this process runs torch {torch.__version__}")
    cpu_code = "cpu" in got["host"]
    mine = _host_facts(cpu_code)
    if (cpu_code and not mine["cpu"]) or got["host"] != mine:
        differ = sorted(k for k in set(mine) | set(got["host"]) if got["host"].get(k) != mine.get(k))
        return _not_used("host", "it was compiled on a host that differs from this one in "
                         f"{', '.join(differ) or 'cpu (unknown here)'}")
    if cpu_code and not got["isa"]:
        return _not_used("isa", "its graphs hold C++ code but it does not say for which vector instructions")
    from torch._inductor import codecache

    root = codecache.cache_dir()
    if got["isa"]:
        # The probes first: inductor picks the vector instructions by them (and its own check of
        # this CPU's features), loading each here; their verdicts are not handed over.
        for rel, content, _ in got["probes"]:
            _write_absent(root, rel, content)
        from torch._inductor.cpu_vec_isa import pick_vec_isa

        isa = str(pick_vec_isa())
        if isa != got["isa"]:
            return _not_used("isa", f"its graphs are for {got['isa']} vector instructions, "
                             f"inductor picks {isa} here")
    for artifacts in got["artifacts"]:
        if torch.compiler.load_cache_artifacts(artifacts) is None:
            return _not_used("artifacts", "torch could not read its cache artifacts")
    for rel, content, cache in got["files"]:
        if _write_absent(root, rel, content):
            # Only a file that holds these bytes whole is entered: written here, or by another
            # rank of the host from the same part. Anything else at the name (a compile not
            # finished, a link) is left to inductor, which locks and checks.
            _enter(getattr(codecache, cache), os.path.basename(rel).split(".")[0], os.path.join(root, rel))
    _received.extend(got["artifacts"])
    _installed = True
    return True


def _enter(cache, key, path):
    """The kernel compiled for ``key`` in inductor's code cache, as inductor enters one it
    compiled: a function that loads the library once. Not when the key is there already."""
    if key in cache.cache:
        return
    lib = None

    def load():
        nonlocal lib
        if lib is None:
            lib = cache._load_library(path, key)
        return lib

    cache.cache[key] = load


def _write_absent(root, rel, content):
    """Writes a kernel where inductor would have compiled it, unless something is there: whole
    or not at all (a temporary file of its own, then a rename that follows no link). Returns
    whether the name now holds these bytes: written here, or a regular file equal to them."""
    path = os.path.join(root, rel)
    if os.path.lexists(path):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return False
        with os.fdopen(fd, "rb") as f:
            return f.read(len(content) + 1) == content
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".rlaunch-", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.chmod(tmp, 0o755)
        os.replace(tmp, path)
        return True
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
