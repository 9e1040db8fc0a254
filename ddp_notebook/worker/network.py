"""What an engine knows and does about the network, for runs whose ranks are on several hosts.

``interfaces`` (this host's IPv4 and IPv6 addresses by interface), ``machine_key`` (what tells two
hosts apart: two engines with the same key share a loopback), the reachability probe validation
runs before a run (``open_probe`` on rank 0's engine, ``reach`` on every other engine: the address
of rank 0 each can connect to, and the interface it leaves by, which becomes its gloo/NCCL
interface), and ``keep_alive`` (the kernel ends this process's TCP connections to a host that
stopped answering, so a collective blocked on one fails within the network timeout instead of
after the group's).

Addresses are plain strings, IPv4 (``10.0.0.11``) or IPv6 (``fd00::11``), never bracketed: socket
calls and torch's ``TCPStore`` take them so (a bracketed one is no host name to them); ``shown``
brackets an IPv6 address beside a port for messages.

Standard library and psutil only; Linux (``/proc``) where it matters, harmless elsewhere.
"""
from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import psutil

__all__ = ["interfaces", "machine_key", "open_probe", "close_probe", "reach", "keep_alive", "PROBE_SECONDS",
           "normalised", "is_loopback", "family_of", "shown"]

PROBE_SECONDS = 30.0  # how long a probe listener waits for its peers at most (closed once they came)
_probes: list[threading.Event] = []  # this engine's open probes: set one to close it


def normalised(address: str) -> str:
    """``address`` in the one spelling two equal addresses share, to compare them: no brackets,
    IPv6 compressed, and an IPv4-mapped IPv6 address (``::ffff:10.0.0.1``, what an IPv6 socket
    sees of an IPv4 peer) as the IPv4 address. Anything else (a host name) as it is."""
    text = address.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        return text
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


def is_loopback(address: str) -> bool:
    """Whether ``address`` is a loopback address (``127.0.0.0/8``, ``::1``)."""
    try:
        return ipaddress.ip_address(normalised(address)).is_loopback
    except ValueError:  # a host name
        return address.startswith("127.")


def family_of(address: str) -> socket.AddressFamily:
    """The socket family for ``address``: ``AF_INET6`` for an IPv6 address, else ``AF_INET`` (an
    IPv4 address, or a host name as before)."""
    return socket.AF_INET6 if ":" in normalised(address) else socket.AF_INET


def shown(address: str, port: int) -> str:
    """``address:port`` for a message, an IPv6 address bracketed (``[fd00::11]:29500``)."""
    plain = normalised(address)
    return f"[{plain}]:{port}" if ":" in plain else f"{plain}:{port}"


def _is_link_local(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_link_local
    except ValueError:
        return True  # not an address a peer could use either


def interfaces() -> dict[str, list[str]]:
    """``{interface: [address, ...]}`` of this host's interfaces that have an IPv4 or IPv6
    address, in the system's order of interfaces: in each, IPv4 addresses first (the primary
    one first), then IPv6. Link-local IPv6 addresses (``fe80::/10``) are left out: they mean
    something only with their interface's scope, and every host has one on every link."""
    try:
        found = psutil.net_if_addrs()
    except (OSError, RuntimeError):  # no getifaddrs here
        return {}
    try:
        order = {name: index for index, name in socket.if_nameindex()}
    except OSError:
        order = {}
    out: dict[str, list[str]] = {}
    for name in sorted(found, key=lambda n: order.get(n, len(order))):  # stable: aliases after, as psutil has them
        v4 = [a.address for a in found[name] if a.family == socket.AF_INET]
        v6 = [a.address.split("%", 1)[0] for a in found[name] if a.family == socket.AF_INET6]  # no zone
        v6 = [ip for ip in v6 if not _is_link_local(ip)]
        if v4 or v6:
            out[name] = v4 + v6
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
    """Listen on each of ``addresses`` (this host's, IPv4 or IPv6) for ``seconds``, accepting and
    closing every connection: ``{address: port}`` for those it could listen on. Peers ``reach``
    them."""
    ports: dict[str, int] = {}
    socks = []
    done = threading.Event()
    _probes.append(done)
    for address in addresses:
        try:
            s = socket.socket(family_of(address), socket.SOCK_STREAM)
        except OSError:  # no IPv6 in this kernel
            continue
        try:
            s.bind((normalised(address), 0))
            s.listen(64)
            s.settimeout(0.2)
        except OSError:
            s.close()
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
            with socket.create_connection((normalised(address), port), timeout=timeout) as s:
                local = normalised(s.getsockname()[0])
        except OSError as e:
            errors[address] = "timed out" if isinstance(e, socket.timeout) else (e.strerror or str(e))
            continue
        names = [name for name, ips in interfaces().items() if local in {normalised(ip) for ip in ips}]
        return {"address": address, "local": local, "interface": names[0] if names else None}
    return {"errors": errors}


def _tcp_connections(skip: Iterable[int] = ()) -> Iterator[tuple[int, str, socket.socket]]:
    """This process's connected TCP sockets, IPv4 and IPv6: ``(inode, the peer's address
    normalised, a duplicate of the socket)``, each duplicate closed once the next is asked for;
    none whose inode is in ``skip``. Found from the descriptors themselves: the kernel's text
    table of TCP connections in ``/proc`` lists IPv4 ones only (IPv6 ones are in another), and
    those of the whole network namespace."""
    skipped = set(skip)
    try:
        names = os.listdir("/proc/self/fd")  # only as a list of numbers
    except OSError:
        return
    for name in names:
        if not name.isdigit():
            continue
        try:
            st = os.fstat(int(name))
            if not stat.S_ISSOCK(st.st_mode) or st.st_ino in skipped:
                continue
            dup = os.dup(int(name))
        except OSError:  # closed meanwhile (the listing's own descriptor is)
            continue
        try:
            st = os.fstat(dup)  # the duplicate's: the number may have been reused since
            blocking = os.get_blocking(dup)
            sock = socket.socket(fileno=dup)  # its family, type and protocol asked of the kernel
        except OSError:
            os.close(dup)
            continue
        with sock:
            # The mode belongs to the open file, the owner's too: a default timeout
            # (socket.setdefaulttimeout) made the duplicate non-blocking.
            if os.get_blocking(dup) != blocking:
                os.set_blocking(dup, blocking)
            if (st.st_ino in skipped or sock.family not in (socket.AF_INET, socket.AF_INET6)
                    or sock.type != socket.SOCK_STREAM or sock.proto != socket.IPPROTO_TCP):
                continue
            try:
                peer = sock.getpeername()[0]
            except OSError:  # listening, or not connected (yet)
                continue
            yield st.st_ino, normalised(peer), sock


def keep_alive(addresses: Iterable[str], seconds: float, done: Iterable[int] = ()) -> set[int]:
    """Have the kernel end this process's TCP connections (IPv4 and IPv6) to ``addresses`` once
    the other end has not answered for about ``seconds`` (keepalive probes on an idle connection,
    a user timeout on unacknowledged data): gloo then sees an error instead of waiting for its own
    timeout. The kernel answers probes for a host that is up whatever its processes do. Returns
    the inodes of the sockets set (skipping those in ``done``: a socket is set once)."""
    idle = max(1, int(seconds / 2))
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, int(seconds) - idle)),
                        # Twice: data sent into a short outage is retransmitted with a growing backoff,
                        # and a link back within the timeout must not end the connection.
                        ("TCP_USER_TIMEOUT", int(seconds * 2000))):
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    wanted = {normalised(a) for a in addresses if a}
    out: set[int] = set()
    if not wanted:
        return out
    for inode, peer, sock in _tcp_connections(skip=done):
        if peer not in wanted:
            continue
        with contextlib.suppress(OSError):
            for level, option, value in options:
                sock.setsockopt(level, option, value)  # options belong to the socket: the duplicate sets them
            out.add(inode)
    return out
