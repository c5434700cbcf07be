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
  compiled probes travel, never their verdict: the new host still runs each on its own CPU.

Inductor compiles its C++ with ``-march=native``, which its file names do not tell apart: a
kernel compiled on one CPU may use an instruction another lacks. The compiled files are
installed only on a host whose CPU has every feature the saving host's had (``/proc/cpuinfo``'s
flags); elsewhere only torch's artifacts are (said once), and the kernels are compiled there.

Loaded only into a process that has compiled no graph yet, once: survivors keep what they have.
The bytes are code. ``load(compiled=True)`` runs what a rank of the job compiled, which is why it
is asked for by name and never done by ``load`` alone.

Layout (little-endian): ``RLCOMP01``, a u32 length, that many bytes of JSON ``{"torch": version,
"cpu": [flag, ...], "artifacts": n, "files": [[path, n], ...]}``, then the artifacts' bytes and
each file's, in order.
"""

import glob
import json
import os
import re
import struct
import sys

_MAGIC = b"RLCOMP01"
# A kernel's path in inductor's cache directory: two characters of its hash, then the hash.
_FILE = re.compile(r"^[a-z0-9_]{2}/[A-Za-z0-9_]{8,128}(\.main)?\.so$")

_last = None  # (what it was made from, the bytes)
_installed = False
_said = set()


def _say_once(what, line):
    if what not in _said:
        _said.add(what)
        print(f"rlaunch.snapshot: {line}", file=sys.stderr, flush=True)


def _kernel_keys(codecache):
    keys = set()
    for name in ("CppCodeCache", "CppPythonBindingsCodeCache", "CppWrapperCodeCache"):
        keys.update(getattr(getattr(codecache, name, None), "cache", {}) or {})
    return keys


def _cpu_flags():
    """The CPU's features as the kernel lists them (the first processor's), or [] if unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return sorted(set(value.split()))
    except OSError:
        pass
    return []


def _compiled_graphs():
    """How many graphs dynamo compiled in this process (0 when it never ran)."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    return int(utils.counters["stats"].get("unique_graphs", 0))


def blob():
    """This process's compile output as one ``bytes``, or None when it compiled nothing. Made
    again only when something new was compiled since the last call: otherwise the same bytes."""
    global _last
    if _compiled_graphs() == 0:
        return None
    import torch
    from torch._inductor import codecache
    from torch.compiler._cache import CacheArtifactManager

    keys = frozenset(_kernel_keys(codecache))
    made_from = (keys, _compiled_graphs())
    if _last is not None and _last[0] == made_from and not CacheArtifactManager.need_serialize():
        return _last[1]
    saved = torch.compiler.save_cache_artifacts()
    artifacts = saved[0] if saved else b""
    root = codecache.cache_dir()
    wanted = {f"{key[1:3]}/{key}{ext}" for key in keys for ext in (".so", ".main.so")}
    # The CPU probes: the kernels whose loading inductor marked as having worked on this CPU.
    for marker in glob.glob(os.path.join(glob.escape(root), "*", "*.so.load_ok")):
        wanted.add(os.path.relpath(marker[:-len(".load_ok")], root))
    files = []
    for rel in sorted(wanted):
        if not _FILE.match(rel):
            continue
        try:
            with open(os.path.join(root, rel), "rb") as f:
                files.append((rel, f.read()))
        except FileNotFoundError:
            pass
    head = json.dumps({"torch": torch.__version__, "cpu": _cpu_flags(), "artifacts": len(artifacts),
                       "files": [[rel, len(data)] for rel, data in files]}).encode()
    out = b"".join([_MAGIC, struct.pack("<I", len(head)), head, artifacts] + [d for _, d in files])
    _last = (made_from, out)
    return out


def _parse(data):
    """(torch version, CPU flags, artifacts, [(path, bytes)]) of a blob, or raises ValueError
    naming why."""
    data = memoryview(data)
    if len(data) < 12 or bytes(data[:8]) != _MAGIC:
        raise ValueError("not rlaunch's compiled bytes")
    (hlen,) = struct.unpack("<I", data[8:12])
    if 12 + hlen > len(data):
        raise ValueError("shorter than its header says")
    try:
        head = json.loads(bytes(data[12:12 + hlen]))
    except ValueError:
        raise ValueError("its header is not JSON") from None
    if not isinstance(head, dict):
        raise ValueError("its header is not an object")
    version, n, files = head.get("torch"), head.get("artifacts"), head.get("files")
    cpu = head.get("cpu")
    if (not isinstance(version, str) or type(n) is not int or n < 0 or not isinstance(files, list)
            or not isinstance(cpu, list) or not all(isinstance(c, str) for c in cpu)
            or not all(isinstance(e, list) and len(e) == 2 and isinstance(e[0], str)
                       and type(e[1]) is int and e[1] >= 0 for e in files)):
        raise ValueError("its header is not rlaunch's")
    for rel, _ in files:
        if not _FILE.match(rel):
            raise ValueError(f"it names a file {rel!r} that is not a kernel of inductor's cache")
    at = 12 + hlen
    if at + n + sum(size for _, size in files) != len(data):
        raise ValueError("its length is not what its header says")
    artifacts = bytes(data[at:at + n])
    at += n
    out = []
    for rel, size in files:
        out.append((rel, bytes(data[at:at + size])))
        at += size
    return version, cpu, artifacts, out


def install(data):
    """Puts a blob's compile output where this process's ``torch.compile`` looks first. Does
    nothing in a process that already compiled a graph or installed a blob. Returns whether it
    installed; says once on stderr why not when the blob cannot be used."""
    global _installed
    if _installed or _compiled_graphs() > 0:
        return False
    try:
        version, cpu, artifacts, files = _parse(data)
    except ValueError as e:
        _say_once("bad", f"the compiled code that came with the snapshot is not used: {e}")
        return False
    import torch

    if version != torch.__version__:
        _say_once("version", f"the compiled code that came with the snapshot is not used: it is "
                  f"torch {version}'s, this process runs torch {torch.__version__}")
        return False
    from torch._inductor import codecache

    lacking = sorted(set(cpu) - set(_cpu_flags())) if files else []
    if lacking:
        _say_once("cpu", "the kernels compiled with the snapshot are not used (this CPU lacks "
                  f"{', '.join(lacking[:8])}{' …' if len(lacking) > 8 else ''}): they are compiled "
                  "here, the graphs are still loaded")
        files = []
    root = codecache.cache_dir()
    for rel, content in files:
        _write_absent(os.path.join(root, rel), content)
    if artifacts:
        torch.compiler.load_cache_artifacts(artifacts)
    _installed = True
    return True


def _write_absent(path, content):
    """Writes a kernel where inductor would have compiled it, unless it is there: whole or not at
    all (a temporary name, then a rename), never following a link at the name."""
    if os.path.lexists(path):
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.rlaunch-{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o755)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(content)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
