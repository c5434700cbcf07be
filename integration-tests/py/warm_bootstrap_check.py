# Drives rlaunch's warm bootstrap (agent/src/warm/bootstrap.py, argv[1]) as the agent does: an
# interpreter started with RANK=0 imports ahead an installed module (in a site-packages folder,
# argv[2]) that either looks RANK up or only scans the environment; once that import is done
# (the module touches a marker), the order gives RANK=1. Prints one JSON line: whether the
# worker is still the warm interpreter (else it started again cold by exec), the RANK the
# module saw at its import, and the worker's RANK.
import json
import os
import subprocess
import sys
import tempfile
import time

bootstrap, site, module = sys.argv[1], sys.argv[2], sys.argv[3]
work = tempfile.mkdtemp(prefix="warm-bootstrap-")
marker = os.path.join(work, "imported")
with open(os.path.join(site, f"{module}.py"), "w") as f:
    f.write(
        "import os\n"
        + (
            "RANK = os.environ.get('RANK')\n"
            if module == "looks_rank_up"
            else "RANK = {k: v for k, v in os.environ.items() if k == 'RANK'}.get('RANK')\n"
        )
        + f"open({marker!r}, 'a').close()\n"
    )
prog = os.path.join(work, "prog.py")
with open(prog, "w") as f:
    f.write(
        f"import json\nimport os\nimport {module}\n"
        "print(json.dumps({'warm': b'bootstrap.py' in open('/proc/self/cmdline', 'rb').read(),"
        f" 'at_import': {module}.RANK, 'rank': os.environ['RANK']}}), flush=True)\n"
    )
r, w = os.pipe()
env = dict(os.environ, RANK="0", PYTHONPATH=site)
child = subprocess.Popen(
    [sys.executable, "-u", bootstrap, str(r), "script", prog], pass_fds=(r,), env=env, stdout=subprocess.PIPE
)
os.close(r)
deadline = time.time() + 60
while not os.path.exists(marker):
    assert time.time() < deadline, "the warm-up never imported the module"
    time.sleep(0.02)
time.sleep(0.2)
argv = [sys.executable, "-u", prog]
order = {
    "argv": [a.encode().hex() for a in argv],
    "target_index": 2,
    # How the worker's environment differs from the one the interpreter was started with.
    "env": [[b"RANK".hex(), b"0".hex(), b"1".hex()]],
    "cwd": work.encode().hex(),
}
os.write(w, json.dumps(order).encode())
os.close(w)
out, _ = child.communicate(timeout=60)
assert child.returncode == 0, child.returncode
print(out.decode().strip().splitlines()[-1])
