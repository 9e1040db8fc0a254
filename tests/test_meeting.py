"""Where ranks on engines meet (``worker.meeting``), their pulse (``worker.pulse``) and the network
probes (``worker.network``), in this process: a real TCPStore, real sockets, threads for ranks.

Connections are made on 127.0.0.2 (loopback too) where a test changes them, so nothing else of
this process (a cluster's client on 127.0.0.1) is touched. IPv6 has one loopback address (``::1``):
a test that changes connections there passes every other socket of this process as already done.
The tests that open sockets or start a store are ``processes`` tests, not unit ones."""
import contextlib
import ipaddress
import os
import socket
import stat
import threading

import pytest

from ddp_notebook.core.events import EventKind
from ddp_notebook.worker.meeting import Meeting, RunEndedError
from ddp_notebook.worker.network import close_probe, interfaces, keep_alive, machine_key, open_probe, reach
from ddp_notebook.worker.pulse import Pulse

from helpers import wait_until


def ipv6_loopback() -> bool:
    """Whether this machine has ``::1`` (IPv6 may be off in a container)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# Asked when a test that needs it runs (a string condition), not on import: collecting the unit
# tests opens no socket.
needs_ipv6 = pytest.mark.skipif("not ipv6_loopback()", reason="no IPv6 loopback address (::1) here")


def loopback_has_ipv6() -> bool:
    """Whether the kernel lists ``::1`` on ``lo`` (/proc/net/if_inet6: read, no socket)."""
    try:
        with open("/proc/net/if_inet6") as f:
            return any(line.split()[0] == "0" * 31 + "1" and line.split()[-1] == "lo" for line in f if line.strip())
    except OSError:  # no IPv6 in this kernel
        return False


def inode(s):
    return os.fstat(s.fileno()).st_ino


def other_sockets(*mine):
    """The inodes of this process's sockets but ``mine``: as ``done``, they keep ``keep_alive`` off
    every connection of this process that the test did not make."""
    out = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            st = os.fstat(int(name))
            if stat.S_ISSOCK(st.st_mode):
                out.add(st.st_ino)
    return out - {inode(s) for s in mine}


def assert_kept_alive(s):
    assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
    assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
    assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20_000


def test_interfaces_and_machine_key_describe_this_host():
    found = interfaces()
    assert found.get("lo", [])[:1] == ["127.0.0.1"]  # IPv4 first, as before
    for addresses in found.values():
        assert addresses and all(not ipaddress.ip_address(a).is_link_local for a in addresses), found
        versions = [ipaddress.ip_address(a).version for a in addresses]
        assert versions == sorted(versions), found
    assert ("::1" in found["lo"]) == loopback_has_ipv6(), found
    assert machine_key() == machine_key() and machine_key().startswith(socket.gethostname() + "/")


@pytest.mark.processes
def test_reach_finds_the_address_that_answers_and_the_interface_it_leaves_by():
    ports = open_probe(["127.0.0.1", "203.0.113.9"], seconds=5)  # the second is not this host's
    assert list(ports) == ["127.0.0.1"]
    with socket.create_server(("127.0.0.1", 0)) as closed:
        refused = closed.getsockname()[1]
    found = reach([("127.0.0.1", refused), ("127.0.0.1", ports["127.0.0.1"])], timeout=2)
    assert found == {"address": "127.0.0.1", "local": "127.0.0.1", "interface": "lo"}
    assert reach([("127.0.0.1", refused)], timeout=2) == {"errors": {"127.0.0.1": "Connection refused"}}
    close_probe()  # every peer has tried: the listener goes at once, not after its 5 s
    wait_until(lambda: "errors" in reach([("127.0.0.1", ports["127.0.0.1"])], timeout=2), timeout=3)


@pytest.mark.processes
def test_keep_alive_sets_the_kernel_s_timeouts_on_this_process_s_connections_to_an_address():
    with socket.create_server(("127.0.0.2", 0)) as server, \
            socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as datagrams:
        datagrams.connect(("127.0.0.2", 9))  # it has a peer too, but is no TCP connection
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()  # its peer is 127.0.0.1: loopback's source address
        try:
            assert keep_alive(["127.0.0.3"], 10) == set()
            done = keep_alive(["127.0.0.2"], 10)
            assert done == {inode(client)}  # not the listener, not the datagram socket
            assert keep_alive(["127.0.0.2"], 10, done) == set()  # each socket once
            assert_kept_alive(client)  # on the owner's socket
            assert client.fileno() >= 0 and client.getblocking()  # the descriptor is still the owner's, as it was
            assert peer.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 0
        finally:
            client.close()
            peer.close()


@pytest.mark.processes
@needs_ipv6
def test_keep_alive_finds_and_sets_this_process_s_ipv6_connections():
    with socket.create_server(("::1", 0), family=socket.AF_INET6) as server:
        client = socket.create_connection(("::1", server.getsockname()[1]))
        peer, _ = server.accept()  # its peer is ::1 too
        try:
            others = other_sockets(client, peer)  # the listener has no peer: it counts as another
            assert keep_alive(["fd00:db8::1"], 10, others) == set()
            done = keep_alive(["0:0:0:0:0:0:0:1"], 10, others)  # ::1 spelt out
            assert done == {inode(client), inode(peer)}
            assert keep_alive(["[::1]"], 10, others | done) == set()
            for s in (client, peer):
                assert_kept_alive(s)
        finally:
            client.close()
            peer.close()


@pytest.mark.processes
@needs_ipv6
def test_keep_alive_takes_the_ipv4_peer_of_an_ipv6_socket_as_ipv4():
    with socket.create_server(("127.0.0.2", 0)) as server, socket.socket(socket.AF_INET6) as client:
        try:
            client.connect(("::ffff:127.0.0.2", server.getsockname()[1]))  # a dual-stack socket
        except OSError as e:
            pytest.skip(f"no IPv4-mapped IPv6 connection here: {e}")
        peer, _ = server.accept()
        try:
            assert client.getpeername()[0] == "::ffff:127.0.0.2"
            assert keep_alive(["127.0.0.2"], 10) == {inode(client)}
            assert_kept_alive(client)
        finally:
            peer.close()


@pytest.mark.processes
def test_ranks_meet_under_the_run_s_secret_and_leave_when_the_run_ends():
    host = Meeting.host("127.0.0.1", "s3cret", timeout=30)
    guest = Meeting.join("127.0.0.1", host.port, "s3cret", timeout=30)
    stranger = Meeting.client("127.0.0.1", host.port, 5)  # connected, without the secret
    try:
        arrived = []
        t = threading.Thread(target=lambda: arrived.append(guest.arrive("arrived", 1, 2, timeout=30)))
        t.start()
        host.arrive("arrived", 0, 2, timeout=30)
        t.join(30)
        assert arrived == [None]
        assert not stranger.check(["arrived"]) and host.store.check(["arrived"])  # the keys are under the secret
        errors = []

        def wait_for_a_third():
            try:
                guest.arrive("returned", 1, 3, timeout=30)
            except BaseException as e:  # noqa: BLE001
                errors.append(e)

        t = threading.Thread(target=wait_for_a_third)
        t.start()
        host.end()
        t.join(30)
        assert [type(e) for e in errors] == [RunEndedError]
    finally:
        guest.close()
        host.close()
    with pytest.raises(RunEndedError, match="cannot be reached"):
        Meeting.join("127.0.0.1", host.port, "s3cret", timeout=30, connect=1)


@pytest.mark.processes
@needs_ipv6
def test_ranks_meet_and_probe_over_ipv6():
    ports = open_probe(["::1"], seconds=5)
    try:
        assert reach([("::1", ports["::1"])], timeout=2) == {"address": "::1", "local": "::1", "interface": "lo"}
    finally:
        close_probe()
    host = Meeting.host("::1", "v6", timeout=30)
    guest = Meeting.join("::1", host.port, "v6", timeout=30)
    try:
        arrived = []
        t = threading.Thread(target=lambda: arrived.append(guest.arrive("arrived", 1, 2, timeout=30)))
        t.start()
        host.arrive("arrived", 0, 2, timeout=30)
        t.join(30)
        assert arrived == [None] and host.address == "::1"
    finally:
        guest.close()
        host.close()
    with pytest.raises(RunEndedError, match=rf"the run's store at \[::1\]:{host.port} \(rank 0's engine\)"):
        Meeting.join("::1", host.port, "v6", timeout=30, connect=1)


@pytest.mark.processes
def test_a_pulse_says_alive_forwards_stacks_keeps_links_alive_and_names_a_silent_peer(tmp_path):
    host = Meeting.host("127.0.0.1", "k", timeout=30)
    guest = Meeting.join("127.0.0.1", host.port, "k", timeout=30)
    host.store.set("address/0", "127.0.0.1")
    host.store.set("address/1", "127.0.0.2")  # where rank 1's "gloo pairs" are
    sent = []
    stacks = tmp_path / "stacks"
    stacks.write_text("")
    readable, empty = os.open(stacks, os.O_RDONLY), os.open(os.devnull, os.O_RDONLY)
    zero = Pulse(0, 2, sent.append, readable, network_timeout=2.0)
    one = Pulse(1, 2, lambda event: None, empty, network_timeout=2.0)
    with socket.create_server(("127.0.0.2", 0)) as server:
        pair = socket.create_connection(server.getsockname())
        try:
            zero.start()
            one.start()
            zero.watch(host)
            one.watch(guest)
            stacks.write_text("Thread 0x1 (most recent call first):\n")
            wait_until(lambda: any(e["kind"] == EventKind.STACKS for e in sent), timeout=10)
            assert [e["text"] for e in sent if e["kind"] == EventKind.STACKS] == [
                "Thread 0x1 (most recent call first):\n"]
            assert any(e["kind"] == EventKind.ALIVE for e in sent)
            wait_until(lambda: pair.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1, timeout=10)
            # Both beat a few times: nobody is silent.
            wait_until(lambda: min(host.store.add("beat/0", 0), host.store.add("beat/1", 0)) >= 3, timeout=30)
            assert zero.unreachable() == {} and one.unreachable() == {}
            one.stop()  # rank 1 falls silent
            wait_until(lambda: zero.unreachable(), timeout=15)
            assert list(zero.unreachable()) == [1]
        finally:
            zero.stop()
            one.stop()
            os.close(readable)
            os.close(empty)
            pair.close()
            guest.close()
            host.close()


def test_no_stack_file_is_left_world_readable(tmp_path):
    from ddp_notebook.worker.execute import install_stack_dump, remove_stack_dump

    path = str(tmp_path / "s")
    f = install_stack_dump(path)
    try:
        assert os.stat(path).st_mode & 0o077 == 0
    finally:
        remove_stack_dump(f)
