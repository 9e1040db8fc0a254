"""Runs on ipyparallel engines on simulated hosts whose network is IPv6 only
(``hosts.SimulatedHosts(ipv6=True)``): each host's address on the hosts' bridge is an IPv6 (ULA)
address and no host reaches another over IPv4, so the ranks' own traffic (the reachability probe,
rank 0's store, gloo) is IPv6 only.

ipyparallel's controller cannot be reached over IPv6 (its ZeroMQ sockets would need the ``IPV6``
option, which it never sets): each host keeps a second link for the controller's connection
alone, on IPv4, with a route to the controller and nowhere else. Rank 0's probe listens on that
IPv4 address too, but no peer has a route to it: their connection fails at once and the next
address, IPv6, is the one they reach. A host cut off loses both links, as a host would.

Three hosts with one engine each; the test that cuts a link comes last and mends it."""
import os
import time

import pytest
import torch

import ddp_notebook
from ddp_notebook.worker.network import is_loopback

from hosts import assert_engines_clean, check_a_host_cut_off_mid_run, simulated

pytestmark = pytest.mark.multihost


@pytest.fixture(scope="module")
def hosts():
    yield from simulated([1, 1, 1], tag="v6", ipv6=True)


def _unset_keepalive(addresses):
    """This process's TCP connections to ``addresses`` whose kernel keepalive is not on yet."""
    import socket

    import psutil

    out = []
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.raddr and c.raddr.ip in addresses and c.status == psutil.CONN_ESTABLISHED:
            try:
                with socket.socket(fileno=os.dup(c.fd)) as s:
                    if not s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE):
                        out.append(c.raddr.ip)
            except OSError:  # closed meanwhile
                pass
    return out


def traffic(ctx, addresses):
    """After a collective: this rank's host, its gloo interface, the TCP connections and listeners
    of its engine process (read in its host's network namespace: psutil reads the caller's), and
    its connections to the hosts' ``addresses`` still without keepalive once its pulse beat a few
    times (``[]``: the pulse found them all), gathered from every rank."""
    import socket

    import psutil

    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    deadline = time.monotonic() + 30  # the pulse sets them within a beat (1 s)
    while _unset_keepalive(addresses) and time.monotonic() < deadline:
        time.sleep(0.1)
    # The engine's loopback connections and listeners (ipyparallel's, ZeroMQ's) are there before any run.
    connections = [c for c in psutil.Process().net_connections(kind="tcp") if not is_loopback(c.laddr.ip)]
    mine = [socket.gethostname(), os.environ.get("GLOO_SOCKET_IFNAME"), float(t),
            sorted({c.raddr.ip for c in connections if c.status == psutil.CONN_ESTABLISHED and c.raddr}),
            sorted({c.laddr.ip for c in connections if c.status == psutil.CONN_LISTEN}),
            _unset_keepalive(addresses)]
    out = [None] * ctx.world_size
    torch.distributed.all_gather_object(out, mine)
    return out


def test_the_ranks_traffic_is_ipv6_only(hosts):
    found = ddp_notebook.launch(traffic, engines=hosts.view([0, 1, 2]), args=(hosts.addresses,)).wait(timeout=120)
    assert [f[:3] for f in found] == [[name, link, 3.0] for name, link in zip(hosts.names, hosts.links)]
    for (_host, _link, _sum, peers, listeners, unset), address in zip(found, hosts.addresses):
        assert unset == [], unset  # keepalive and the user timeout on every IPv6 connection to a peer host
        # The engine's connections to the controller are the only IPv4 ones; the store, the beats
        # and gloo's pairs go to the hosts' IPv6 addresses (rank 0's own too: its store), and
        # listen on this host's.
        others = set(peers) - {hosts.bridge_ip}
        assert set(hosts.addresses) - {address} <= others <= set(hosts.addresses), peers
        assert set(listeners) == {address}, listeners
    assert_engines_clean(hosts)


def test_a_fit_on_ipv6_only_hosts_trains(hosts):
    torch.manual_seed(0)
    x = torch.randn(384, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])

    def model():
        torch.manual_seed(1)
        return torch.nn.Linear(4, 1)

    result = ddp_notebook.fit(model, (x, y), loss=torch.nn.functional.mse_loss,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.05), epochs=2, batch_size=16,
                              shuffle=False, checkpoint=False, engines=hosts.view([0, 1, 2]))
    assert result.ranks_in_sync
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"], result.history
    assert_engines_clean(hosts)


def test_a_session_on_ipv6_only_hosts_runs_cells(hosts):
    # The ranks reach the notebook's request store on an address the probe found for them.
    s = ddp_notebook.session(engines=hosts.view([0, 1, 2]))
    try:
        assert s.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()") == [6.0, 6.0, 6.0]
    finally:
        s.close()
    assert_engines_clean(hosts)


def test_a_host_cut_off_mid_run_is_named_within_the_same_bound_as_on_ipv4(hosts, monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_NETWORK_TIMEOUT", "5")  # not 10 s: the bound follows it
    check_a_host_cut_off_mid_run(hosts)  # as on IPv4: the ranks' IPv6 connections get keepalive too
    assert_engines_clean(hosts)
