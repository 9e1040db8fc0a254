"""How a run's ranks on engines reach each other: the ``NetworkPlan`` found before the run.

On one host every rank uses loopback. On several hosts rank 0's engine listens for a moment on
each of its addresses (``worker.network.open_probe``) and every engine on another host tries to
connect (``reach``): rank 0's address is the one the others reach, and each engine's interface
for gloo/NCCL is the one its connection left by (the user's ``GLOO_SOCKET_IFNAME`` /
``NCCL_SOCKET_IFNAME`` in ``env=`` still win). An engine that reaches none of rank 0's addresses
is a validation error, found before anything starts.

    plan = plan_network(engines, 3)
    plan.address, plan.interfaces, plan.problems    # "10.0.0.11", ["eth0", "eth1", "eth0"], []
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from ...core.switches import seconds_from_env
from ...worker.network import close_probe, open_probe, reach

__all__ = ["NetworkPlan", "plan_network", "machines_of", "network_timeout", "NETWORK_TIMEOUT_ENV"]

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


def plan_network(engines: Any, n: int) -> NetworkPlan:
    """How the first ``n`` engines of ``engines`` (an ``Engines``) reach each other."""
    info = engines.describe()[:n]
    machines = machines_of(info)
    if len(set(machines)) <= 1 or any("error" in i for i in info):
        return NetworkPlan("127.0.0.1", ["127.0.0.1"] * n, ["lo"] * n, several_hosts=False)
    ids, client = engines.ids, engines.client
    first = info[0]
    names = {ip: name for name, ip in (first.get("addresses") or {}).items()}
    candidates = [ip for ip in names if not ip.startswith("127.")]
    where0 = f"engine {ids[0]} (host {first.get('host')})"
    try:
        ports = client[ids[0]].apply_async(open_probe, candidates).get(timeout=_ANSWER)
    except Exception as e:  # noqa: BLE001 - RemoteError, TimeoutError
        return NetworkPlan("127.0.0.1", [], [], True, [f"rank 0's {where0} could not listen for its peers: {e}"])
    targets = sorted(ports.items(), key=lambda t: candidates.index(t[0]))
    others = [r for r in range(1, n) if machines[r] != machines[0]]
    pending = {r: client[ids[r]].apply_async(reach, targets) for r in others}
    answers: dict[int, dict[str, Any]] = {}
    problems = []
    for r, ar in pending.items():
        try:
            answers[r] = dict(ar.get(timeout=_ANSWER))
        except Exception as e:  # noqa: BLE001
            answers[r] = {"errors": {"?": str(e)}}
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
    address = reached.most_common(1)[0][0] if reached else (candidates[0] if candidates else "127.0.0.1")
    local, interfaces = [], []
    for r in range(n):
        if machines[r] == machines[0]:
            local.append(address)
            interfaces.append(names.get(address))
        else:
            local.append(answers[r].get("local") or "")
            interfaces.append(answers[r].get("interface"))
    return NetworkPlan(address, local, interfaces, True, problems)
