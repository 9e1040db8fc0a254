"""Addresses IPv4 and IPv6 alike, without a socket: how they are compared and shown
(``worker.network``), how the network plan orders an engine's addresses, and the check of an
interface the user names, with engines that give a list of addresses per interface (and those
of an earlier version, one IPv4 address)."""
import socket

from ddp_notebook.executors.ipyparallel.engine_checks import _interface_findings
from ddp_notebook.executors.ipyparallel.network_plan import _addresses_of, _loopback
from ddp_notebook.worker.network import family_of, is_loopback, normalised, shown


def test_addresses_are_compared_in_one_spelling():
    assert normalised("::ffff:10.0.0.1") == "10.0.0.1"  # an IPv4 peer as an IPv6 socket sees it
    assert normalised("[FD00:0:0::0011]") == normalised("fd00::11") == "fd00::11"
    assert normalised("10.0.0.1") == "10.0.0.1" and normalised("gpu-a") == "gpu-a"
    assert is_loopback("::1") and is_loopback("127.0.0.2") and not is_loopback("fd00::1")
    assert family_of("fd00::11") == socket.AF_INET6 and family_of("10.0.0.1") == family_of("gpu-a") == socket.AF_INET
    assert shown("fd00::11", 29500) == "[fd00::11]:29500" and shown("10.0.0.1", 29500) == "10.0.0.1:29500"


def test_the_plan_tries_rank_0_s_ipv4_addresses_first_and_takes_its_loopback():
    both = {"addresses": {"lo": ["127.0.0.1", "::1"], "eth0": ["10.0.0.1", "fd00::1"], "eth1": ["10.1.0.1"]}}
    assert list(_addresses_of(both).items()) == [
        ("127.0.0.1", "lo"), ("10.0.0.1", "eth0"), ("10.1.0.1", "eth1"), ("::1", "lo"), ("fd00::1", "eth0")]
    earlier = {"addresses": {"lo": "127.0.0.1", "eth0": "10.0.0.1"}}  # an engine of an earlier version
    assert _addresses_of(earlier) == {"127.0.0.1": "lo", "10.0.0.1": "eth0"}
    assert _loopback([both]) == _loopback([earlier]) == _loopback([]) == "127.0.0.1"
    assert _loopback([{"addresses": {"lo": ["::1"], "eth0": ["fd00::1"]}}]) == "::1"


def test_an_interface_named_in_env_is_checked_with_ipv6_addresses_too():
    def engine(host, lo, eth0):
        return {"host": host, "machine": host, "addresses": {"lo": lo, "eth0": eth0}}

    ipv6_only = [engine("a", ["::1"], ["fd00::1"]), engine("b", ["::1"], ["fd00::2"])]
    assert _interface_findings({"GLOO_SOCKET_IFNAME": "eth0"}, [0, 1], ipv6_only) == []
    loopback = _interface_findings({"GLOO_SOCKET_IFNAME": "lo"}, [0, 1], ipv6_only)
    assert [f.message for f in loopback] == [
        "GLOO_SOCKET_IFNAME='lo' (env=) is loopback on engine 0 (host a): ranks on several hosts cannot reach each "
        "other over it. Leave it unset, or name an interface that reaches rank 0's host."]
    both = [engine("a", ["127.0.0.1", "::1"], ["10.0.0.1", "fd00::1"]), engine("b", "127.0.0.1", "10.0.0.2")]
    assert [f.code for f in _interface_findings({"NCCL_SOCKET_IFNAME": "lo"}, [0, 1], both)] == ["network"]
    assert _interface_findings({"NCCL_SOCKET_IFNAME": "eth0"}, [0, 1], both) == []
