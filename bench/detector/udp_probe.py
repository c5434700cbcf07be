"""A ping without ping (the image has none): UDP echo, to check that the loss rules drop what
they should before a run. `udp_probe.py server IP PORT [SECONDS]` echoes datagrams for SECONDS
(default 60); `udp_probe.py client IP PORT N` sends N numbered datagrams, one at a time, waits
up to 50 ms for each echo and prints the percentage that came back with no echo (round trip:
with loss P each way, about 1 - (1 - P)^2)."""

import socket
import sys
import time


def main():
    mode, ip, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    if mode == "server":
        s.bind((ip, port))
        end = time.time() + (float(sys.argv[4]) if len(sys.argv) > 4 else 60.0)
        while time.time() < end:
            s.settimeout(max(0.01, end - time.time()))
            try:
                data, peer = s.recvfrom(64)
            except socket.timeout:
                break
            s.sendto(data, peer)
        return
    n, got = int(sys.argv[4]), 0
    for i in range(n):
        msg = str(i).encode()
        s.sendto(msg, (ip, port))
        end = time.time() + 0.05
        while True:
            left = end - time.time()
            if left <= 0:
                break
            s.settimeout(left)
            try:
                data, _ = s.recvfrom(64)
            except socket.timeout:
                break
            if data == msg:
                got += 1
                break
    print(f"{100.0 * (n - got) / n:.1f}")


if __name__ == "__main__":
    main()
