"""`@rlaunch.resilient` against a scripted agent on a real control socket (the protocol of
agent/src/control.rs), in one process: a round ends while the function runs; the next round ends
again right behind its resume; the function must not run on in that round (it is not run, or its
saves are closed at once), and runs with the third round's environment. Prints `ok N` (N: the
runs) or fails."""

import json
import os
import socket
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

tmp = tempfile.mkdtemp()
path = os.path.join(tmp, "control.sock")
server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
server.bind(path)
server.listen(1)
os.environ["RLAUNCH_CONTROL"] = path
os.environ["LOCAL_RANK"] = "0"
entered = threading.Event()
failures = []


def agent():
    try:
        conn, _ = server.accept()
        conn.settimeout(30)
        r = conn.makefile("rb")

        def send(msg):
            conn.sendall((json.dumps(msg) + "\n").encode())

        def expect(key):
            msg = json.loads(r.readline())
            assert key in msg, msg
            return msg[key]

        assert expect("hello")["local_rank"] == 0
        send({"welcome": {}})
        assert entered.wait(30)
        send({"end": {"round": 1, "hosts": ["127.0.0.1"]}})
        assert expect("parked")["round"] == 1
        # The resume and, right behind it in the same write, the next round's end.
        conn.sendall((json.dumps({"resume": {"round": 2, "env": {"RLAUNCH_TEST_ROUND": "2"}}}) + "\n"
                      + json.dumps({"end": {"round": 2, "hosts": ["127.0.0.1"]}}) + "\n").encode())
        assert expect("parked")["round"] == 2
        send({"resume": {"round": 3, "env": {"RLAUNCH_TEST_ROUND": "3"}}})
        time.sleep(30)  # the connection open until the process ends
    except BaseException as e:  # noqa: BLE001 - reported by the main thread
        failures.append(repr(e))


threading.Thread(target=agent, daemon=True).start()

import rlaunch  # noqa: E402
from rlaunch.resilient import saves_closed  # noqa: E402

runs = 0


@rlaunch.resilient
def train():
    global runs
    runs += 1
    if runs == 1:
        assert not saves_closed()
        entered.set()
        deadline = time.monotonic() + 30
        while not saves_closed():
            assert time.monotonic() < deadline, "no word of the round's end"
            time.sleep(0.005)
        raise RuntimeError("gloo: connection closed by peer")  # as a failed collective
    round_ = os.environ["RLAUNCH_TEST_ROUND"]
    if round_ == "2":
        deadline = time.monotonic() + 5
        while not saves_closed():
            assert time.monotonic() < deadline, "round 2 ran on after its end"
            time.sleep(0.001)
        raise RuntimeError("gloo: connection closed by peer")
    assert not saves_closed(), "saves open again in a round that runs"
    return int(round_)


got = train()
assert not failures, failures
assert got == 3, got
print(f"ok {runs}")
