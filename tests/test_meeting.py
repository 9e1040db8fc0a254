"""Where ranks on engines meet (``worker.meeting``), their pulse (``worker.pulse``) and the network
probes (``worker.network``), in this process: a real TCPStore, real sockets, threads for ranks.

Connections are made on 127.0.0.2 (loopback too) where a test changes them, so nothing else of
this process (a cluster's client on 127.0.0.1) is touched."""
import os
import socket
import threading
import time

import pytest

from ddp_notebook.core.events import EventKind
from ddp_notebook.worker.meeting import Meeting, RunEndedError
from ddp_notebook.worker.network import close_probe, interfaces, keep_alive, machine_key, open_probe, reach
from ddp_notebook.worker.pulse import Pulse

from helpers import wait_until


def test_interfaces_and_machine_key_describe_this_host():
    assert interfaces().get("lo") == "127.0.0.1"
    assert machine_key() == machine_key() and machine_key().startswith(socket.gethostname() + "/")


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


def test_keep_alive_sets_the_kernel_s_timeouts_on_this_process_s_connections_to_an_address():
    with socket.create_server(("127.0.0.2", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
        try:
            assert keep_alive(["127.0.0.3"], 10) == set()
            done = keep_alive(["127.0.0.2"], 10)
            assert len(done) == 1 and keep_alive(["127.0.0.2"], 10, done) == set()  # each socket once
            assert client.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1  # on the owner's socket
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 5
            assert client.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == 20_000
            assert client.fileno() >= 0  # the descriptor is still the owner's
        finally:
            client.close()
            peer.close()


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


def test_a_pulse_says_alive_forwards_stacks_keeps_links_alive_and_names_a_silent_peer(tmp_path):
    host = Meeting.host("127.0.0.1", "k", timeout=30)
    guest = Meeting.join("127.0.0.1", host.port, "k", timeout=30)
    host.store.set("address/0", "127.0.0.1")
    host.store.set("address/1", "127.0.0.2")  # where rank 1's "gloo pairs" are
    sent = []
    stacks = tmp_path / "stacks"
    stacks.write_text("")
    zero = Pulse(0, 2, sent.append, str(stacks), network_timeout=2.0)
    one = Pulse(1, 2, lambda event: None, str(tmp_path / "none"), network_timeout=2.0)
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
            time.sleep(2)  # both beat: nobody is silent
            assert zero.unreachable() == {} and one.unreachable() == {}
            one.stop()  # rank 1 falls silent
            wait_until(lambda: zero.unreachable(), timeout=15)
            assert list(zero.unreachable()) == [1]
        finally:
            zero.stop()
            one.stop()
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
