"""What an engine knows and does about the network, for runs whose ranks are on several hosts.

``interfaces`` (this host's IPv4 addresses by interface), ``machine_key`` (what tells two hosts
apart: two engines with the same key share a loopback), the reachability probe validation runs
before a run (``open_probe`` on rank 0's engine, ``reach`` on every other engine: the address of
rank 0 each can connect to, and the interface it leaves by, which becomes its gloo/NCCL
interface), and ``keep_alive`` (the kernel ends this process's TCP connections to a host that
stopped answering, so a collective blocked on one fails within the network timeout instead of
after the group's).

Standard library only; Linux (``/proc``) where it matters, harmless elsewhere.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["interfaces", "machine_key", "open_probe", "close_probe", "reach", "keep_alive", "PROBE_SECONDS"]

PROBE_SECONDS = 30.0  # how long a probe listener waits for its peers at most (closed once they came)
_probes: list[threading.Event] = []  # this engine's open probes: set one to close it
_SIOCGIFADDR = 0x8915


def interfaces() -> dict[str, str]:
    """``{interface: IPv4 address}`` of this host's interfaces that are up and have one."""
    out: dict[str, str] = {}
    try:
        names = [name for _i, name in socket.if_nameindex()]
    except OSError:
        return out
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address, or down
                continue
            out[name] = socket.inet_ntoa(packed[20:24])
    return out


def machine_key() -> str:
    """What tells this host from another: its name, its kernel's boot id and its network
    namespace. Engines with the same key share a loopback interface (one host for the run)."""
    parts = [socket.gethostname()]
    for path in ("/proc/sys/kernel/random/boot_id", "/proc/self/ns/net"):
        try:
            parts.append(os.readlink(path) if path.endswith("/net") else open(path).read().strip())
        except OSError:
            parts.append("?")
    return "/".join(parts)


def open_probe(addresses: Sequence[str], seconds: float = PROBE_SECONDS) -> dict[str, int]:
    """Listen on each of ``addresses`` (this host's) for ``seconds``, accepting and closing every
    connection: ``{address: port}`` for those it could listen on. Peers ``reach`` them."""
    ports: dict[str, int] = {}
    socks = []
    done = threading.Event()
    _probes.append(done)
    for address in addresses:
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((address, 0))
            s.listen(64)
            s.settimeout(0.2)
        except OSError:
            continue
        socks.append(s)
        ports[address] = s.getsockname()[1]

    def serve() -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not done.is_set():
            for s in socks:
                with contextlib.suppress(OSError):
                    conn, _ = s.accept()
                    conn.close()
        for s in socks:
            s.close()
        with contextlib.suppress(ValueError):
            _probes.remove(done)

    threading.Thread(target=serve, name="ddp-probe", daemon=True).start()
    return ports


def close_probe() -> None:
    """Close this engine's probes now (every peer has tried)."""
    for done in list(_probes):
        done.set()


def reach(targets: Sequence[tuple[str, int]], timeout: float = 5.0) -> dict[str, Any]:
    """Connect to the first of ``targets`` ((address, port) of rank 0's probe) that answers:
    ``{"address": ..., "local": this host's address on that route, "interface": its name}``, or
    ``{"errors": {address: why}}`` when none does."""
    errors: dict[str, str] = {}
    for address, port in targets:
        try:
            with socket.create_connection((address, port), timeout=timeout) as s:
                local = s.getsockname()[0]
        except OSError as e:
            errors[address] = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
            continue
        names = [name for name, ip in interfaces().items() if ip == local]
        return {"address": address, "local": local, "interface": names[0] if names else None}
    return {"errors": errors}


def _socket_inodes() -> dict[int, int]:
    """``{socket inode: fd}`` of this process's open sockets."""
    out: dict[int, int] = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    out[int(link[8:-1])] = int(fd)
    return out


def _remote_ipv4(hexaddr: str) -> str:
    return socket.inet_ntoa(struct.pack("<I", int(hexaddr.split(":")[0], 16)))


def _connections_to(addresses: Iterable[str]) -> dict[int, int]:
    """``{socket inode: fd}`` of this process's TCP connections to ``addresses``."""
    wanted = set(addresses)
    fds = _socket_inodes()
    out: dict[int, int] = {}
    with contextlib.suppress(OSError), open("/proc/self/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            inode = int(fields[9])
            if inode in fds and _remote_ipv4(fields[2]) in wanted:
                out[inode] = fds[inode]
    return out


def keep_alive(addresses: Iterable[str], seconds: float, done: Iterable[int] = ()) -> set[int]:
    """Have the kernel end this process's TCP connections to ``addresses`` once the other end has
    not answered for about ``seconds`` (keepalive probes on an idle connection, a user timeout on
    unacknowledged data): gloo then sees an error instead of waiting for its own timeout. The
    kernel answers probes for a host that is up whatever its processes do. Returns the inodes of
    the sockets set (skipping ``done``)."""
    idle = max(1, int(seconds / 2))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, int(seconds) - idle)),
                        # Twice: data sent into a short outage is retransmitted with a growing backoff,
                        # and a link back within the timeout must not end the connection.
                        ("TCP_USER_TIMEOUT", int(seconds * 2000))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    skip = set(done)
    out = set()
    for inode, fd in _connections_to(addresses).items():
        if inode in skip:
            continue
        with contextlib.suppress(OSError):
            dup = socket.socket(fileno=os.dup(fd))  # options belong to the socket: the duplicate sets them
            try:
                for level, option, value in options:
                    dup.setsockopt(level, option, value)
                out.add(inode)
            finally:
                dup.close()
    return out
