"""`rlaunch.compiled.install` checks a blob before it writes anything, and never raises (run outside
rlaunch, with the package on PYTHONPATH).

    compiled_untrusted.py DIR

Inductor's cache is DIR/cache. Each case prints `case NAME: installed=BOOL`; the last line is
`ok`. Refused whole, nothing written (asserted): a file named to escape the cache (`..`, an
absolute path, a trailing newline, a directory that is not its hash's), a header that lies about
the length, is not JSON, nests past Python's recursion limit or names a code cache that is not
inductor's, another torch's code, a host that differs (a CPU feature, the compiler, what
-march=native means, the machine, features unknown here), graphs for other vector instructions
or for none named, artifacts torch cannot read, a cache directory that cannot be written.
Installed: a valid blob whose kernel's name is already a link (the link not followed, its target
unchanged, the kernel not entered in inductor's code cache: what was there is inductor's to
check), a valid blob (its kernel written whole where inductor looks and entered in its code
cache); then a second valid blob in the same process is not (a process installs once); in a
fresh process's stead, a blob whose kernels are there already, one with the same bytes (entered)
and one with others (left as it is, not entered).
"""

import copy
import json
import os
import struct
import sys

DIR = sys.argv[1]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(DIR, "cache")

import torch  # noqa: E402
from torch._inductor.cpu_vec_isa import pick_vec_isa  # noqa: E402

from rlaunch import compiled  # noqa: E402

KEY = "cabcdefghijklmnopqrstuvwxyz0123456789"
REL = f"{KEY[1:3]}/{KEY}.so"
CACHE = os.path.join(DIR, "cache")
HOST = compiled._host_facts(True)
ISA = str(pick_vec_isa())


def blob(files, version=None, host=None, isa=None, claim=None, artifacts=b"", cache="CppPythonBindingsCodeCache"):
    head = {"torch": version or torch.__version__, "host": HOST if host is None else host,
            "isa": ISA if isa is None else isa, "artifacts": [len(artifacts)] if artifacts else [], "probes": [],
            "files": [[rel, len(data) if claim is None else claim, cache] for rel, data in files]}
    h = json.dumps(head).encode()
    return compiled._MAGIC + struct.pack("<I", len(h)) + h + artifacts + b"".join(d for _, d in files)


def case(name, data, written=None):
    compiled._installed = False
    print(f"case {name}: installed={compiled.install(data)}", flush=True)
    if written is not None:
        assert not os.path.lexists(written), f"{name}: {written} was written"


def other(**changes):
    h = copy.deepcopy(HOST)
    h.update(changes)
    return h


kernel = os.path.join(CACHE, REL)
case("traversal", blob([("../../escaped.so", b"x")]), os.path.join(DIR, "escaped.so"))
case("absolute", blob([(os.path.join(DIR, "abs.so"), b"x")]), os.path.join(DIR, "abs.so"))
case("newline", blob([(REL + "\n", b"x")]), kernel + "\n")
case("wrong_dir", blob([(f"zz/{KEY}.so", b"x")]), os.path.join(CACHE, "zz"))
case("short", blob([(REL, b"abc")], claim=10), kernel)
case("cache_name", blob([(REL, b"abc")], cache="__builtins__"), kernel)
case("not_json", compiled._MAGIC + struct.pack("<I", 5) + b"{nope")
deep = b"[" * 100000 + b"]" * 100000
case("deep", compiled._MAGIC + struct.pack("<I", len(deep)) + deep)
case("version", blob([(REL, b"abc")], version="0.0.1"), kernel)
case("cpu", blob([(REL, b"abc")], host=other(cpu=HOST["cpu"] + ["a_feature_no_cpu_has"])), kernel)
case("compiler", blob([(REL, b"abc")], host=other(compiler="g++ 1.0")), kernel)
case("native", blob([(REL, b"abc")], host=other(native="another CPU's -march=native")), kernel)
case("machine", blob([(REL, b"abc")], host=other(machine="riscv128")), kernel)
cached = compiled._host
compiled._host = dict(cached, cpu=[])  # as if this CPU's features were unknown
case("unknown", blob([(REL, b"abc")], host=other(cpu=[])), kernel)
compiled._host = cached
case("isa", blob([(REL, b"abc")], isa="VecNONE9000"), kernel)
case("no_isa", blob([(REL, b"abc")], isa=""), kernel)
case("artifacts", blob([], artifacts=b"not torch's artifacts"))
os.makedirs(CACHE, exist_ok=True)
with open(os.path.join(CACHE, KEY[1:3]), "w") as f:
    f.write("a file where a directory would go")
case("unwritable", blob([(REL, b"abc")]))
os.unlink(os.path.join(CACHE, KEY[1:3]))
os.makedirs(os.path.join(CACHE, KEY[1:3]))
with open(os.path.join(DIR, "target"), "wb") as f:
    f.write(b"mine")
os.symlink(os.path.join(DIR, "target"), kernel)
case("link", blob([(REL, b"theirs")]))
with open(os.path.join(DIR, "target"), "rb") as f:
    assert f.read() == b"mine", "the link was followed"
os.unlink(kernel)
from torch._inductor import codecache  # noqa: E402

assert KEY not in codecache.CppPythonBindingsCodeCache.cache, "a kernel that was there already was entered"
case("good", blob([(REL, b"\x7fELF kernel")]))
with open(kernel, "rb") as f:
    assert f.read() == b"\x7fELF kernel"

assert KEY in codecache.CppPythonBindingsCodeCache.cache, "the kernel was not entered under its key"
assert not [n for n in os.listdir(os.path.join(CACHE, KEY[1:3])) if n.endswith(".tmp")]
print(f"case once: installed={compiled.install(blob([(REL, b'other')]))}", flush=True)
# Another rank of the host, from the same part: the kernel is there with the same bytes (entered),
# or with other bytes, say a compile not finished (left to inductor, not rewritten).
codecache.CppPythonBindingsCodeCache.cache.pop(KEY)
KEY2 = "czyxwvutsrqponmlkjihgfedcba9876543210"
REL2 = f"{KEY2[1:3]}/{KEY2}.so"
os.makedirs(os.path.join(CACHE, KEY2[1:3]), exist_ok=True)
with open(os.path.join(CACHE, REL2), "wb") as f:
    f.write(b"\x7fELF half")
case("same_and_other", blob([(REL, b"\x7fELF kernel"), (REL2, b"\x7fELF whole")]))
assert KEY in codecache.CppPythonBindingsCodeCache.cache, "a kernel with the same bytes was not entered"
assert KEY2 not in codecache.CppPythonBindingsCodeCache.cache, "a kernel with other bytes was entered"
with open(os.path.join(CACHE, REL2), "rb") as f:
    assert f.read() == b"\x7fELF half", "a file at a kernel's name was rewritten"
print("ok", flush=True)
