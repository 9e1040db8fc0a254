"""Simulated hosts for the ``multihost`` tests: one Linux network namespace per host, each with its
own address on a bridge, its own hostname (a UTS namespace) and its own runs folder (a private
tmpfs in a mount namespace), and one ipyparallel engine in each. The controller and the notebook
(this process) stay in the root namespace, on the bridge's address.

Needs root (``ip netns``, ``unshare``). Every name and address is unique to this process and
everything is removed at the end, even when the test fails. No route leads beyond the bridge.

    with SimulatedHosts([2, 1], run_root) as hosts:   # two engines on host h1, one on h2
        hosts.client            # an ipyparallel Client
        hosts.view([0, 1])      # the first engine of h1, then of h2
        hosts.cut(1)            # host h2's link goes down (a partition, not a death)

With ``ipv6=True`` the hosts' network is IPv6 only: each host's address on the bridge is an IPv6
one (a ULA prefix of this process, ``nodad`` so it is usable at once, no link-local address),
and no host reaches another over IPv4. ipyparallel's controller cannot be reached over IPv6 (its
ZeroMQ sockets would need the ``IPV6`` option, which it never sets), so each host has a second
link for that alone, on a second bridge: an IPv4 ``/32`` address with a route to the controller
and nowhere else (a connection from one host to another's IPv4 address fails at once: no route).
"""
from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import ipyparallel as ipp
import pytest

import ddp_notebook
from ddp_notebook import WorkerFailedError
from ddp_notebook.executors.ipyparallel.network_plan import network_timeout

import faults
from helpers import CONTROLLER_ARGS, wait_for

HERE = os.path.dirname(os.path.abspath(__file__))
# The controller pings as the tests' do (``helpers.CONTROLLER_ARGS``); an engine that hears no ping
# leaves after 175 missed checks (one every 1 s, the period + 0.5 s), as long as by default.
ENGINE_ARGS = ["--IPEngine.max_heartbeat_misses=175"]


def simulated(layout: list[int], **options):
    """A module fixture's body: ``SimulatedHosts(layout, ...)`` for the module's tests, skipped
    where hosts cannot be simulated (not root), and failed there in CI, which runs as root."""
    why = can_simulate_hosts()
    if why:
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)
    with SimulatedHosts(layout, os.environ["DDP_NOTEBOOK_RUNS"], **options) as hosts:
        yield hosts


def can_simulate_hosts() -> str:
    """'' when this machine can simulate hosts, else why not."""
    if os.geteuid() != 0:
        return "simulated hosts need root (ip netns, unshare)"
    for tool in ("ip", "unshare", "mount"):
        if shutil.which(tool) is None:
            return f"simulated hosts need {tool}"
    return ""


def _run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def listening(pids: list[int]) -> dict[int, set[tuple[str, int]]]:
    """(address, port) each process listens on over TCP, IPv4 and IPv6 (an IPv6 address
    compressed, ``::`` for any), read in its own network namespace (psutil reads this process's)."""
    out = {}
    for pid in pids:
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
        found = set()
        for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            with open(f"/proc/{pid}/net/{table}") as f:
                for line in f.readlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                        address, port = fields[1].split(":")
                        raw = bytes.fromhex(address)  # 32-bit words, each in the host's byte order
                        words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                        found.add((socket.inet_ntop(family, words), int(port, 16)))
        out[pid] = found
    return out


class SimulatedHosts:
    """``len(layout)`` hosts, ``layout[h]`` engines on host ``names[h]`` at ``addresses[h]``."""

    def __init__(self, layout: list[int], run_root: str, tag: str = "", ipv6: bool = False) -> None:
        n = self.n = len(layout)
        self.layout = list(layout)
        self.engine_host = [h for h, k in enumerate(layout) for _ in range(k)]
        self.run_root = run_root
        self.ipv6 = ipv6
        uid = f"{os.getpid() % 10000}{tag}"
        self.prefix = f"dn{uid}"
        self.bridge = f"br{self.prefix}"[:15]
        subnet = 20 + os.getpid() % 200
        self.names = [f"h{i + 1}" for i in range(n)]
        self.namespaces = [f"{self.prefix}h{i + 1}" for i in range(n)]
        self.veths = [f"v{self.prefix}h{i + 1}"[:15] for i in range(n)]  # the root namespace's ends
        self.links = [f"e{veth[1:]}"[:15] for veth in self.veths]  # each host's end: its interface on the bridge
        if ipv6:
            self.bridge_ip = f"10.214.{subnet}.1"  # the controller's, on the control bridge
            # A ULA prefix of this process (never the machine's own fd00::/64).
            self.addresses = [str(ipaddress.ip_address(f"fd5e:dd9b:{os.getpid() % 65536:x}::{11 + i}"))
                              for i in range(n)]
            self.control_bridge = f"bc{self.prefix}"[:15]
            self.control_veths = [f"w{self.prefix}h{i + 1}"[:15] for i in range(n)]
            self.control_links = [f"c{veth[1:]}"[:15] for veth in self.control_veths]
            self.control_addresses = [f"10.214.{subnet}.{11 + i}" for i in range(n)]
        else:
            self.bridge_ip = f"10.213.{subnet}.1"
            self.addresses = [f"10.213.{subnet}.{11 + i}" for i in range(n)]
            self.control_bridge, self.control_veths, self.control_links = None, [], []
            self.control_addresses = list(self.addresses)  # one link for everything
        self.procs: list[subprocess.Popen | None] = [None] * len(self.engine_host)
        self.tmp = tempfile.mkdtemp(prefix="ddp-hosts-")
        self.cluster = None
        self.client = None

    # ---- set up / tear down ------------------------------------------------------------------
    def __enter__(self) -> SimulatedHosts:
        # A test session ended by SIGTERM (a CI timeout) runs no fixture teardown: clean up then too.
        self._previous_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._network()
            self.cluster = ipp.Cluster(n=0, controller_ip=self.bridge_ip, profile_dir=os.path.join(self.tmp, "profile"),
                                       log_level=40, controller_args=CONTROLLER_ARGS)
            self.cluster.start_controller_sync()
            for e in range(len(self.engine_host)):
                self.start_engine(e)
            self.client = self.cluster.connect_client_sync()
            self.wait_for_engines()
            self.client[:].execute(f"import sys; sys.path.insert(0, {HERE!r})", block=True)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
        signal.signal(signal.SIGTERM, self._previous_term)

    def _on_term(self, signum: int, frame: object) -> None:
        self.close()
        raise SystemExit(128 + signum)

    def _network(self) -> None:
        self.close_network()
        if self.ipv6:
            self._network_ipv6()
            return
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "link", "set", self.bridge, "up")
        _run("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        for ns, veth, inner, addr in zip(self.namespaces, self.veths, self.links, self.addresses):
            _run("ip", "netns", "add", ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", inner)
            _run("ip", "link", "set", inner, "netns", ns)
            _run("ip", "link", "set", veth, "master", self.bridge)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/24", "dev", inner)
            _run("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
            _run("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")

    def _network_ipv6(self) -> None:
        """The hosts' bridge with IPv6 addresses only (the root namespace has none there: only the
        hosts talk on it), and the control bridge: the controller's IPv4 address, each host's
        /32 with a route to it alone. No link gets a link-local address (``addrgenmode none``)."""
        for bridge in (self.bridge, self.control_bridge):
            _run("ip", "link", "add", bridge, "type", "bridge")
            _run("ip", "link", "set", bridge, "addrgenmode", "none")
            _run("ip", "link", "set", bridge, "up")
        _run("ip", "addr", "add", f"{self.bridge_ip}/24", "dev", self.control_bridge)
        for i, ns in enumerate(self.namespaces):
            _run("ip", "netns", "add", ns)
            for bridge, veth, inner in ((self.bridge, self.veths[i], self.links[i]),
                                        (self.control_bridge, self.control_veths[i], self.control_links[i])):
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", inner)
                _run("ip", "link", "set", inner, "netns", ns)
                _run("ip", "link", "set", veth, "addrgenmode", "none")
                _run("ip", "link", "set", veth, "master", bridge)
                _run("ip", "link", "set", veth, "up")
                _run("ip", "-n", ns, "link", "set", inner, "addrgenmode", "none")
            _run("ip", "-n", ns, "addr", "add", f"{self.addresses[i]}/64", "dev", self.links[i], "nodad")
            _run("ip", "-n", ns, "addr", "add", f"{self.control_addresses[i]}/32", "dev", self.control_links[i])
            for inner in (self.links[i], self.control_links[i], "lo"):
                _run("ip", "-n", ns, "link", "set", inner, "up")
            _run("ip", "-n", ns, "route", "add", f"{self.bridge_ip}/32", "dev", self.control_links[i])

    def start_engine(self, e: int) -> None:
        """Engine e, on its host: the host's name and network, its own (empty) runs folder."""
        i = self.engine_host[e]
        engine_file = os.path.join(self.cluster.profile_dir, "security",
                                   f"ipcontroller-{self.cluster.cluster_id}-engine.json")
        deadline = time.monotonic() + 60
        while not os.path.exists(engine_file):
            assert time.monotonic() < deadline, "the controller wrote no connection file"
            time.sleep(0.1)
        private = [self.run_root, os.path.join(os.path.expanduser("~"), ".cache", "ddp_notebook")]
        mounts = " && ".join(f"mkdir -p {p} && mount -t tmpfs -o mode=700 tmpfs {p}" for p in private)
        script = (f"hostname {self.names[i]} && {mounts} && "
                  f"exec {sys.executable} -m ipyparallel.engine --file={engine_file} --log-level=40 "
                  f"{' '.join(ENGINE_ARGS)}")
        log = open(os.path.join(self.tmp, f"engine-{e}.log"), "ab")
        self.procs[e] = subprocess.Popen(
            ["ip", "netns", "exec", self.namespaces[i], "unshare", "--uts", "--mount", "--propagation", "private",
             "sh", "-c", script], stdout=log, stderr=log, start_new_session=True)

    def wait_for_engines(self) -> None:
        """Until every engine is up; then ``on_host[h]``: the ids of host h's engines."""
        self.client.wait_for_engines(len(self.engine_host), timeout=120)
        ids = list(self.client.ids)
        hosts = self.client[ids].apply_sync(__import__("socket").gethostname)
        self.on_host = [[eid for eid, name in zip(ids, hosts) if name == host] for host in self.names]
        self.client[ids].execute(f"import sys; sys.path.insert(0, {HERE!r})", block=True)

    def view(self, hosts=None):
        """The DirectView of the first engine of each of ``hosts`` (indices; all by default)."""
        hosts = range(self.n) if hosts is None else hosts
        return self.client[[self.on_host[h][0] for h in hosts]]

    def close_network(self) -> None:
        for ns in self.namespaces:
            _run("ip", "netns", "del", ns, check=False)
        for veth in self.veths + self.control_veths:
            _run("ip", "link", "del", veth, check=False)
        for bridge in (self.bridge, self.control_bridge):
            if bridge:
                _run("ip", "link", "del", bridge, check=False)

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        for e in range(len(self.procs)):
            self.stop_engine(e)
        if self.cluster is not None:
            try:
                self.cluster.stop_cluster_sync()
            except Exception:  # noqa: BLE001
                pass
        self.close_network()
        shutil.rmtree(self.tmp, ignore_errors=True)

    # ---- faults ------------------------------------------------------------------------------
    def stop_engine(self, e: int) -> None:
        proc = self.procs[e]
        if proc is None:
            return
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)
        self.procs[e] = None

    def _links_of(self, i: int) -> list[str]:
        return [self.veths[i]] + self.control_veths[i:i + 1]

    def cut(self, i: int) -> None:
        """Host i drops off the network (its links go down: peers see silence, not resets)."""
        for veth in self._links_of(i):
            _run("ip", "link", "set", veth, "down")

    def mend(self, i: int) -> None:
        """Host i's links come back; the neighbours it could not reach meanwhile are forgotten (a
        failed ARP or neighbour discovery entry answers "no route to host" for a while, as on a
        real network)."""
        for veth in self._links_of(i):
            _run("ip", "link", "set", veth, "up")
        for ns in self.namespaces:
            for family in ("-4", "-6"):
                _run("ip", family, "-n", ns, "neigh", "flush", "all", check=False)


CLEAN = {"process_group": False, "rank_env": None, "sigint": True, "context": False, "torchs_init": True}


def assert_engines_clean(hosts: SimulatedHosts) -> None:
    """Every engine is as a run found it (``faults.engine_is_clean``)."""
    states = hosts.client[:].apply_async(faults.engine_is_clean).get(timeout=60)
    for state in states:
        assert {k: state[k] for k in CLEAN} == CLEAN, state


def check_a_host_cut_off_mid_run(hosts: SimulatedHosts) -> None:
    """Host 2's link cut while the ranks of three hosts are in all-reduces: the run fails naming
    rank 1 a network failure within the bound (the kernel's keepalive and user timeout end the
    ranks' connections about 2 x the network timeout after the cut, not gloo's 30 minutes), its
    peers are released, the retry runs on hosts 1 and 3, and host 2's engine is free once its link
    is back. The multihost tests run it on IPv4 and on IPv6-only hosts."""
    view = hosts.view([0, 1, 2])  # h2's engine stays busy a moment after the link comes back
    run = ddp_notebook.launch(faults.allreduce_until_stop_agreed, engines=view)
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
        # The peers were released: they report, they do not wait out the group's 30 minutes.
        assert [w.status for w in run.workers][0::2] != ["running", "running"]
        assert named_after < 2 * network_timeout() + 20, named_after  # then the peers' release
        again = run.retry(devices="cpu:0,cpu:2")
        assert again.options.engines.ids == (hosts.on_host[0][0], hosts.on_host[2][0])
        wait_for(again, lambda s: all((w.step or 0) >= 2 for w in s.workers.values()), timeout=120)
        again.stop(wait=True)
        assert again.status == "stopped"
    finally:
        hosts.mend(1)
    # h2's rank lost rank 0's store too: it leaves on its own, and its engine is free again.
    hosts.client[hosts.on_host[1][0]].apply_async(os.getpid).get(timeout=60)
