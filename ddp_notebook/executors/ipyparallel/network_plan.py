"""How a run's ranks on engines reach each other: the ``NetworkPlan`` found before the run.

On one host every rank uses loopback. On several hosts rank 0's engine listens for a moment on
each of its addresses (``worker.network.open_probe``) and every engine on another host tries to
connect (``reach``): rank 0's address is the one the others reach, and each engine's interface
for gloo/NCCL is the one its connection left by (the user's ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` in ``env=`` still win). An engine that reaches none of rank 0's addresses
is a validation error, found before anything starts.

    plan = plan_network(engines, 3)
    plan.address, plan.interfaces, plan.problems    # "10.0.0.11", ["eth0", "eth1", "eth0"], []

Addresses are IPv4 or IPv6 (unbracketed: ``fd00::11``), and rank 0's IPv4 addresses are tried
first, so a network that has both is used as on IPv4 alone. On one host the ranks use loopback:
``127.0.0.1``, or ``::1`` on a host whose loopback has no IPv4 address.

A session's ranks also reach the notebook, which sends them its requests through a store it
hosts (``notebook_address``): the same probe, the other way round (loopback when every engine
shares the notebook's host).
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ...core.switches import seconds_from_env
from ...worker.network import close_probe, interfaces, is_loopback, machine_key, open_probe, reach

__all__ = ["NetworkPlan", "plan_network", "notebook_address", "machines_of", "network_timeout", "NETWORK_TIMEOUT_ENV"]

NETWORK_TIMEOUT_ENV = "DDP_NOTEBOOK_NETWORK_TIMEOUT"
DEFAULT_NETWORK_TIMEOUT = 10.0  # seconds of silence after which a host is taken as cut off
_ANSWER = 30.0  # seconds an engine may take to run the probe


def network_timeout() -> float:
    """Seconds a host may be silent before it is taken as cut off: ``$DDP_NOTEBOOK_NETWORK_TIMEOUT``, else 10."""
    return seconds_from_env(NETWORK_TIMEOUT_ENV, DEFAULT_NETWORK_TIMEOUT)


@dataclass(frozen=True)
class NetworkPlan:
    address: str  # rank 0's address, where its store listens and the others connect
    local: list[str]  # per rank: the address its gloo pairs use
    interfaces: list[Optional[str]]  # per rank: the interface that reaches rank 0 (None: let gloo pick)
    several_hosts: bool
    problems: list[str] = field(default_factory=list)  # engines that cannot reach rank 0 (validation errors)


def machines_of(info: Sequence[dict[str, Any]]) -> list[str]:
    """What tells the engines' hosts apart (engines that share a loopback share a key)."""
    return [str(i.get("machine") or i.get("host", "?")) for i in info]


def _addresses_of(info: dict[str, Any]) -> dict[str, str]:
    """``{address: interface}`` of what an engine said of itself, its IPv4 addresses first, then
    its IPv6 ones (each family in the engine's order). An engine gives a list of addresses per
    interface (one of an earlier version gave one IPv4 address: a string)."""
    pairs = [(ip, name) for name, ips in (info.get("addresses") or {}).items()
             for ip in ([ips] if isinstance(ips, str) else ips)]
    out: dict[str, str] = {}
    for ip, name in sorted(pairs, key=lambda pair: ":" in pair[0]):  # a stable sort: IPv4 first
        out.setdefault(ip, name)
    return out


def _loopback(info: Sequence[dict[str, Any]]) -> str:
    """The loopback address of rank 0's host: ``127.0.0.1``, or ``::1`` where its loopback has only that."""
    loopback = [ip for ip in _addresses_of(info[0]) if is_loopback(ip)] if info else []
    return "::1" if loopback and all(":" in ip for ip in loopback) else "127.0.0.1"


def plan_network(engines: Any, n: int) -> NetworkPlan:
    """How the first ``n`` engines of ``engines`` (an ``Engines``) reach each other."""
    info = engines.describe()[:n]
    machines = machines_of(info)
    loopback = _loopback(info)
    if len(set(machines)) <= 1 or any("error" in i for i in info):
        return NetworkPlan(loopback, [loopback] * n, ["lo"] * n, several_hosts=False)
    ids, client = engines.ids, engines.client
    first = info[0]
    names = _addresses_of(first)
    candidates = [ip for ip in names if not is_loopback(ip)]
    where0 = f"engine {ids[0]} (host {first.get('host')})"
    try:
        ports = client[ids[0]].apply_async(open_probe, candidates).get(timeout=_ANSWER)
    except Exception as e:  # noqa: BLE001 - RemoteError, TimeoutError
        return NetworkPlan(loopback, [], [], True, [f"rank 0's {where0} could not listen for its peers: {e}"])
    targets = sorted(ports.items(), key=lambda t: candidates.index(t[0]))
    others = [r for r in range(1, n) if machines[r] != machines[0]]
    answers = _reached(engines, others, targets)
    problems = []
    for r in others:
        if "errors" in answers[r]:
            tried = "; ".join(f"{a}: {why}" for a, why in answers[r]["errors"].items()) or "it has no address"
            problems.append(f"engine {ids[r]} (host {info[r].get('host')}) cannot reach rank 0's {where0} over TCP "
                            f"({tried}). The engines must reach each other: check firewalls and routes, or choose "
                            "engines on one network.")
    try:
        client[ids[0]].apply_async(close_probe).get(timeout=_ANSWER)
    except Exception:  # noqa: BLE001 - it closes on its own after PROBE_SECONDS
        pass
    reached = Counter(a["address"] for a in answers.values() if "address" in a)
    address = reached.most_common(1)[0][0] if reached else (candidates[0] if candidates else loopback)
    local, interfaces = [], []
    for r in range(n):
        if machines[r] == machines[0]:
            local.append(address)
            interfaces.append(names.get(address))
        else:
            local.append(answers[r].get("local") or "")
            interfaces.append(answers[r].get("interface"))
    return NetworkPlan(address, local, interfaces, True, problems)


def _reached(engines: Any, ranks: Sequence[int], targets: Sequence[tuple[str, int]]) -> dict[int, dict[str, Any]]:
    """What the engines of ``ranks`` said when each tried to ``reach`` ``targets`` (a probe's
    addresses and ports): ``{"address", "local", "interface"}``, or ``{"errors": ...}``."""
    pending = {r: engines.client[engines.ids[r]].apply_async(reach, targets) for r in ranks}
    answers: dict[int, dict[str, Any]] = {}
    for r, ar in pending.items():
        try:
            answers[r] = dict(ar.get(timeout=_ANSWER))
        except Exception as e:  # noqa: BLE001 - RemoteError, TimeoutError
            answers[r] = {"errors": {"?": str(e)}}
    return answers


def notebook_address(engines: Any, n: int) -> tuple[str, list[str]]:
    """The address of this notebook's host that the first ``n`` engines of ``engines`` reach
    (where a session's request store listens), and the problems found (engines that reach none
    of its addresses). Loopback when every engine runs in the notebook's host (and network
    namespace); otherwise this process listens for a moment on each of its addresses and the
    engines elsewhere try them, the address most of them reached winning."""
    info = engines.describe()[:n]
    here = machine_key()
    others = [r for r, machine in enumerate(machines_of(info)) if machine != here]
    own = _addresses_of({"addresses": interfaces()})
    if not others:
        loopback = [ip for ip in own if is_loopback(ip)]
        return ("::1" if loopback and all(":" in ip for ip in loopback) else "127.0.0.1"), []
    candidates = [ip for ip in own if not is_loopback(ip)]
    ports = open_probe(candidates)
    try:
        answers = _reached(engines, others, sorted(ports.items(), key=lambda t: candidates.index(t[0])))
    finally:
        close_probe()
    problems = [f"engine {engines.ids[r]} (host {info[r].get('host')}) cannot reach this notebook over TCP ("
                + ("; ".join(f"{a}: {why}" for a, why in a_["errors"].items()) or "it has no address") + "): a "
                "session's ranks take the notebook's requests from it. Check firewalls and routes, or run "
                "the notebook on the engines' network." for r, a_ in answers.items() if "errors" in a_]
    reached = Counter(a["address"] for a in answers.values() if "address" in a)
    return (reached.most_common(1)[0][0] if reached else ""), problems
