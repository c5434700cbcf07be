"""Ending a collective that waits on a peer that will never answer, from inside the worker.

A gloo collective blocked on a lost peer does not return on ``ProcessGroup.abort()`` (torch 2.15
waited until the peer process exited: 32 s after a link was cut, forever while it is frozen).
What does end it is the transport seeing its connections go: ``interrupt_collectives()`` shuts
down (``shutdown(SHUT_RDWR)``, the descriptors stay open and owned by the transport) every TCP
connection of this process to the given hosts, so each pair waiting in ``recv`` or ``send``
wakes with an error and the collective raises in the thread that waits on it, within
milliseconds. Listening sockets, Unix sockets and connections to other hosts are left alone.

This is the building block of survivors that keep their process (``rlaunch.resilient``, in
progress): the agent knows when a round ended elsewhere and which hosts the round's ranks ran
on; the worker's own thread ends the collective in flight, destroys the process group and makes
a new one in the same process.
"""

import ipaddress
import os
import socket
import sys

_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def _address(hex_addr):
    """``0100007F:1F90`` (as /proc/net/tcp writes it) -> (ip_address, port)."""
    host, port = hex_addr.split(":")
    raw = bytes.fromhex(host)
    # The kernel writes each 32-bit word in host order.
    swap = (lambda w: w[::-1]) if sys.byteorder == "little" else (lambda w: w)
    if len(raw) == 4:
        ip = ipaddress.IPv4Address(swap(raw))
    else:
        words = b"".join(swap(raw[i:i + 4]) for i in range(0, 16, 4))
        ip = ipaddress.IPv6Address(words)
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
    return ip, int(port, 16)


def tcp_connections(pid="self"):
    """This process's TCP sockets that are not listening:
    ``[(fd, inode, local_port, remote_ip, remote_port, state)]``."""
    by_inode = {}
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    state = _TCP_STATES.get(fields[3], fields[3])
                    if state == "LISTEN":
                        continue
                    _, local_port = _address(fields[1])
                    ip, port = _address(fields[2])
                    by_inode[fields[9]] = (local_port, ip, port, state)
        except FileNotFoundError:
            continue
    found = []
    fd_dir = f"/proc/{pid}/fd"
    for name in os.listdir(fd_dir):
        try:
            target = os.readlink(os.path.join(fd_dir, name))
        except OSError:
            continue  # closed meanwhile
        inode = target[8:-1]
        if target.startswith("socket:[") and inode in by_inode:
            local_port, ip, port, state = by_inode[inode]
            found.append((int(name), int(inode), local_port, ip, port, state))
    return sorted(found)


def _ips(hosts):
    """The addresses of ``hosts`` (names or literals)."""
    out = set()
    for h in hosts:
        try:
            out.add(ipaddress.ip_address(h))
            continue
        except ValueError:
            pass
        try:
            for info in socket.getaddrinfo(h, None):
                out.add(ipaddress.ip_address(info[4][0].split("%")[0]))
        except socket.gaierror:
            pass
    return out


def interrupt_collectives(hosts, keep_ports=(), skip_inodes=()):
    """Shuts down this process's TCP connections to ``hosts`` (names or addresses; a loopback
    address stands for every loopback address; no hosts: every host), except those whose
    remote or local port is in ``keep_ports`` (a store this process reaches or serves) and the
    sockets in ``skip_inodes``. Answers how many were shut down. A collective waiting on any of
    them raises in its own thread."""
    targets = _ips(hosts)
    loopback = any(ip.is_loopback for ip in targets)
    done = 0
    for fd, inode, local_port, ip, port, state in tcp_connections():
        if port in keep_ports or local_port in keep_ports or state in ("CLOSE", "TIME_WAIT"):
            continue
        if inode in skip_inodes:
            continue
        if hosts and not (ip in targets or (loopback and ip.is_loopback)):
            continue
        try:
            dup = os.dup(fd)
        except OSError:
            continue  # closed meanwhile
        try:
            # The number may have been closed and given to another socket since the tables
            # were read (a new process group connecting): only the same socket is touched.
            same = os.fstat(dup).st_ino == inode
            s = socket.socket(fileno=dup) if same else None
        except OSError:
            s = None  # not a socket any more
        except BaseException:
            os.close(dup)
            raise
        if s is None:
            os.close(dup)
            continue
        try:
            s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError:
            pass  # not connected (any more)
        finally:
            s.close()  # the duplicate; the transport's own descriptor stays open
    return done
