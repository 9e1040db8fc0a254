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
from ddp_notebook import WorkerFailedError
from ddp_notebook.worker.network import is_loopback

import faults
from helpers import wait_for
from hosts import SimulatedHosts, can_simulate_hosts

pytestmark = pytest.mark.multihost

CLEAN = {"process_group": False, "rank_env": None, "sigint": True, "context": False, "torchs_init": True}


@pytest.fixture(scope="module")
def hosts():
    why = can_simulate_hosts()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)  # CI runs as root: these tests must run there
        pytest.skip(why)
    with SimulatedHosts([1, 1, 1], os.environ["DDP_NOTEBOOK_RUNS"], tag="v6", ipv6=True) as simulated:
        yield simulated


def assert_engines_clean(hosts):
    states = hosts.client[:].apply_async(faults.engine_is_clean).get(timeout=60)
    for state in states:
        assert {k: state[k] for k in CLEAN} == CLEAN, state


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


def test_a_host_cut_off_mid_run_is_named_within_the_same_bound_as_on_ipv4(hosts):
    # As tests/test_multihost.py's IPv4 test: the kernel's keepalive and user timeout on the ranks'
    # IPv6 connections end them about 2 x 10 s after the cut, not gloo's 30 minutes.
    view = hosts.view([0, 1, 2])
    run = ddp_notebook.launch(faults.allreduce_until_stopped, engines=view)
    wait_for(run, lambda s: all((w.step or 0) >= 2 for w in s.workers.values()), timeout=120)
    cut_at = time.monotonic()
    hosts.cut(1)
    try:
        with pytest.raises(WorkerFailedError) as e:
            run.wait(timeout=120)
        named_after = time.monotonic() - cut_at
        failure = e.value.failure
        assert failure.rank == 1 and failure.kind == "network", failure
        assert str(e.value).startswith(f"Distributed data parallel worker 1 (cpu:1 on engine {hosts.on_host[1][0]}) "
                                       "failed: its host dropped off the network: host h2")
        assert all(f.consequence for f in run.failures if f is not failure)
        assert [w.status for w in run.workers][0::2] != ["running", "running"]  # the peers were released
        assert named_after < 40, named_after  # the network timeout (10 s) plus the peers' release
        again = run.retry(devices="cpu:0,cpu:2")
        assert again.options.engines.ids == (hosts.on_host[0][0], hosts.on_host[2][0])
        wait_for(again, lambda s: all((w.step or 0) >= 2 for w in s.workers.values()), timeout=120)
        again.stop(wait=True)
        assert again.status == "stopped"
    finally:
        hosts.mend(1)
    # h2's rank lost rank 0's store too: it leaves on its own, and its engine is free and clean again.
    hosts.client[hosts.on_host[1][0]].apply_async(os.getpid).get(timeout=60)
    assert_engines_clean(hosts)
