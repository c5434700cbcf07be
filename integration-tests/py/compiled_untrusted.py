"""`rlaunch.compiled.install` checks a blob before it writes anything (run outside rlaunch, with the
package on PYTHONPATH).

    compiled_untrusted.py DIR

Inductor's cache is DIR/cache. Each case prints `case NAME: installed=BOOL` and what it left; the
last line is `ok`. Cases:
- `traversal`: a file named `../../escaped.so` (and one named by an absolute path): refused whole,
  nothing written anywhere, DIR/escaped.so absent;
- `short`: a blob whose header promises more bytes than it has: refused;
- `not_json`: a header that is not JSON: refused;
- `version`: another torch's blob: not installed;
- `cpu`: a blob from a CPU with a feature this one lacks: its kernel is not written (the graphs
  would still be);
- `link`: a valid blob whose kernel's name is already a link to DIR/target: the link is not
  followed, DIR/target keeps its bytes;
- `good`: a valid blob: its kernel is written whole where inductor looks, with its bytes;
- `once`: a second valid blob in the same process: not installed (a process installs once).
"""

import json
import os
import struct
import sys

DIR = sys.argv[1]
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(DIR, "cache")

import torch  # noqa: E402

from rlaunch import compiled  # noqa: E402

KEY = "cabcdefghijklmnopqrstuvwxyz0123456789"
REL = f"{KEY[1:3]}/{KEY}.so"


def blob(files, version=None, cpu=None, claim=None):
    head = {"torch": version or torch.__version__, "cpu": compiled._cpu_flags() if cpu is None else cpu,
            "artifacts": 0, "files": [[rel, len(data) if claim is None else claim] for rel, data in files]}
    h = json.dumps(head).encode()
    return compiled._MAGIC + struct.pack("<I", len(h)) + h + b"".join(d for _, d in files)


def fresh():
    compiled._installed = False


def case(name, data):
    fresh()
    print(f"case {name}: installed={compiled.install(data)}", flush=True)


cache = os.path.join(DIR, "cache")
case("traversal", blob([("../../escaped.so", b"x")]))
assert not os.path.exists(os.path.join(DIR, "escaped.so"))
case("absolute", blob([(os.path.join(DIR, "abs.so"), b"x")]))
assert not os.path.exists(os.path.join(DIR, "abs.so"))
case("short", blob([(REL, b"abc")], claim=10))
bad = compiled._MAGIC + struct.pack("<I", 5) + b"{nope"
case("not_json", bad)
case("version", blob([(REL, b"abc")], version="0.0.1"))
case("cpu", blob([(REL, b"abc")], cpu=compiled._cpu_flags() + ["a_feature_no_cpu_has"]))
assert not os.path.exists(os.path.join(cache, REL)), "a kernel from another CPU was written"
os.makedirs(os.path.join(cache, KEY[1:3]), exist_ok=True)
with open(os.path.join(DIR, "target"), "wb") as f:
    f.write(b"mine")
os.symlink(os.path.join(DIR, "target"), os.path.join(cache, REL))
case("link", blob([(REL, b"theirs")]))
with open(os.path.join(DIR, "target"), "rb") as f:
    assert f.read() == b"mine", "the link was followed"
os.unlink(os.path.join(cache, REL))
case("good", blob([(REL, b"\x7fELF kernel")]))
with open(os.path.join(cache, REL), "rb") as f:
    assert f.read() == b"\x7fELF kernel"
assert not [n for n in os.listdir(os.path.join(cache, KEY[1:3])) if n.endswith(".tmp")]
print(f"case once: installed={compiled.install(blob([(REL, b'other')]))}", flush=True)
print("ok", flush=True)
