"""Validation of a device list for a run on engines, where rank r runs on the r-th engine.

Each engine has described itself (``Engines.describe``): a GPU is checked on the host of its
engine, CPU ranks against the cores of their own host; too few engines, an engine that does not
answer or lacks torch, or another ddp_notebook version are findings like any other.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

from ...core.devices import Device, DeviceSpec, parse_devices
from ...core.errors import DeviceSpecError
from ...core.probes import Probe
from ...core.validation import Finding, ValidationReport, validate_devices
from ...core.version import __version__
from ...worker.network import is_loopback
from .engines import Engines

__all__ = ["EngineProbe", "validate_on_engines"]


class EngineProbe(Probe):
    """Answers validation's questions from what the engines said (the most limited engine
    counts: a device list must fit on every engine that runs it)."""

    def __init__(self, info: Sequence[dict[str, Any]]) -> None:
        self.info = [i for i in info if "error" not in i]

    def cpu_count(self) -> int:
        return min((i.get("cpu_count", 1) for i in self.info), default=1)

    def cuda_count(self) -> int:
        return min((i.get("cuda_count", 0) for i in self.info), default=0)

    def cuda_free_memory(self, index: int) -> tuple[int, int]:
        raise NotImplementedError("free GPU memory is not asked of engines")  # see validate_on_engines

    def host_available_memory(self) -> Optional[int]:
        return None

    def nccl_available(self) -> bool:
        return all(i.get("nccl", False) for i in self.info)


# validate_devices' checks that assume every rank is on this machine; redone per engine below.
_PER_MACHINE = ("duplicate", "missing", "oversubscribed", "too_many")


def validate_on_engines(spec: Optional[DeviceSpec], engines: Engines, *, backend: Optional[str] = None,
                        min_free_memory: Optional[int] = None,
                        env: Optional[dict[str, str]] = None) -> ValidationReport:
    """``validate_devices`` for a run on engines, where rank r runs on the r-th engine.

    A GPU is checked on the host of its engine: ``cuda:0,cuda:0`` is valid on two hosts and a
    duplicate on one; ``cuda:1`` must exist on the engine that gets it; CPU ranks are compared
    with the cores of their own host. Also reported: too few engines, an engine that does not
    answer or cannot import torch, another ddp_notebook version. ``spec`` None means ``cpu`` on
    every engine.

    >>> fake = Engines(None, [0, 1])
    >>> fake._info = [{"host": h, "cuda_count": 1, "cpu_count": 8, "nccl": True, "ddp_notebook": "0.1.0"}
    ...               for h in ("gpu-a", "gpu-b")]
    >>> from ddp_notebook.executors.ipyparallel.network_plan import NetworkPlan
    >>> fake._plans[2] = NetworkPlan("10.0.0.11", ["10.0.0.11", "10.0.0.12"], ["eth0", "eth0"], True)  # as probed
    >>> validate_on_engines("cuda:0,cuda:0", fake).ok
    True
    """
    if not engines.ids:  # nothing else can be said of a device list for no engine
        return ValidationReport(str(spec or "cpu"), (), backend, (Finding(
            "error", "engines", "The view has no engines: start some (ipcluster start -n 2, or ipyparallel.Cluster("
            "n=2).start_and_connect_sync()), or choose a view of engines that exist (rc.ids lists them)."),))
    info = engines.describe()
    spec = f"cpu*{len(engines)}" if spec is None else spec
    # A bare "cuda" asks for every GPU; on engines that means as many as the smallest engine has.
    # Only the engines that get a rank count (the view may hold more); how many is known once
    # the spec is read, so read it with every engine first.
    try:
        count = len(parse_devices(spec, cuda_count=EngineProbe(info).cuda_count))
    except DeviceSpecError:
        count = len(info)  # validate_devices reports what is wrong with the spec
    report = validate_devices(spec, backend=backend, probe=EngineProbe(info[:count]))
    findings = [f for f in report.findings if f.code not in _PER_MACHINE]
    if len(report.devices) > len(engines):
        findings.append(Finding("error", "engines", f"{len(report.devices)} devices for {len(engines)} engine"
                                f"{'s' if len(engines) != 1 else ''} (ids {', '.join(map(str, engines.ids))}): "
                                "each engine runs one rank; list fewer devices or start more engines."))
    placed = list(zip(engines.ids, info, report.devices))
    for eid, i, _device in placed:
        if "error" in i:
            findings.append(Finding("error", "engine", i["error"], f"engine {eid}"))
        elif "torch_error" in i:
            findings.append(Finding("error", "engine", f"engine {eid} cannot import torch: {i['torch_error']}"))
        elif i.get("ddp_notebook") != __version__:
            findings.append(Finding("warning", "version", f"engine {eid} has ddp_notebook {i.get('ddp_notebook')}, "
                                    f"this notebook {__version__}: install the same version on every engine."))
    findings += _placement_findings([(rank, eid, i, d) for rank, (eid, i, d) in enumerate(placed)
                                     if "error" not in i and "torch_error" not in i])
    if 0 < len(report.devices) <= len(engines):
        findings += _interface_findings(env or {}, engines.ids[:len(report.devices)], info[:len(report.devices)])
    if not any(f.level == "error" for f in findings) and 0 < len(report.devices) <= len(engines):
        # Only engines that answered and fit the run: whether they reach rank 0 over the network.
        findings += [Finding("error", "network", problem) for problem in engines.network(len(report.devices)).problems]
    if min_free_memory is not None:
        findings.append(Finding("warning", "memory", "min_free_memory is not checked on engines."))
    return ValidationReport(report.spec, report.devices, report.backend, tuple(findings))


_INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _interface_findings(env: dict[str, str], ids: Sequence[int], info: Sequence[dict[str, Any]]) -> list[Finding]:
    """An interface the user's ``env=`` names must exist on every engine, and must not be loopback
    when the ranks are on several hosts (they could never connect: gloo would wait out its timeout)."""
    described = [(eid, i) for eid, i in zip(ids, info) if "error" not in i and "addresses" in i]
    several = len({str(i.get("machine") or i.get("host")) for _eid, i in described}) > 1
    out = []
    for variable in _INTERFACE_VARIABLES:
        wanted = [name.strip() for name in str(env.get(variable) or "").split(",") if name.strip()]
        for name in wanted:
            for eid, i in described:
                addresses = i["addresses"]
                if name not in addresses:
                    has = ", ".join(sorted(addresses)) or "none with an IP address"
                    out.append(Finding("error", "network", f"{variable}={name!r} (env=) names an interface engine "
                                       f"{eid} (host {i.get('host')}) does not have; it has: {has}. Leave it unset: "
                                       "each engine's interface to rank 0 is found before the run."))
                elif several and any(is_loopback(ip) for ip in _listed(addresses[name])):
                    out.append(Finding("error", "network", f"{variable}={name!r} (env=) is loopback on engine {eid} "
                                       f"(host {i.get('host')}): ranks on several hosts cannot reach each other "
                                       "over it. Leave it unset, or name an interface that reaches rank 0's host."))
                    break
    return out


def _listed(addresses: Any) -> list[str]:
    """An interface's addresses as an engine gave them: a list (one of an earlier version gave a string)."""
    return [addresses] if isinstance(addresses, str) else list(addresses)


def _physical_gpu(info: dict[str, Any], index: int) -> str:
    """What tells GPUs of one host apart: the visible-devices entry an engine's cuda:N maps to."""
    visible = [v.strip() for v in (info.get("cuda_visible") or "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def _placement_findings(placed: list[tuple[int, int, dict[str, Any], Device]]) -> list[Finding]:
    """Duplicates, missing GPUs and CPU oversubscription, each judged on the rank's own host.
    ``placed``: (rank, engine id, what the engine said, device) of each rank."""
    out: list[Finding] = []
    ranks: dict[tuple, list[int]] = {}
    named: dict[tuple, tuple[Any, Optional[str]]] = {}
    for rank, _eid, i, d in placed:
        # A CPU slot is a label for the whole run; a GPU is a device of one host.
        key = ("cpu", d) if d.kind == "cpu" else ("gpu", i.get("host"), _physical_gpu(i, d.index))
        ranks.setdefault(key, []).append(rank)
        named.setdefault(key, (d, None if d.kind == "cpu" else i.get("host")))
    for key, rs in ranks.items():
        if len(rs) > 1:
            d, host = named[key]
            where = f" on host {host}" if host else ""
            out.append(Finding("error", "duplicate", f"{d} is listed {len(rs)} times{where} (ranks "
                               f"{', '.join(map(str, rs))}); each device may appear once per host.", str(d)))
    for _rank, eid, i, d in placed:
        count = int(i.get("cuda_count", 0))
        if d.kind == "cuda" and d.index >= count:
            seen = f"{count} CUDA device{'s' if count != 1 else ''}" if count else "no CUDA device"
            out.append(Finding("error", "missing", f"{d} does not exist on engine {eid} (host {i.get('host')}): it "
                               f"sees {seen}.", str(d)))
    cpu_per_host: dict[str, list[int]] = {}
    for _rank, _eid, i, d in placed:
        if d.kind == "cpu":
            cpu_per_host.setdefault(i.get("host", "?"), []).append(int(i.get("cpu_count", 1)))
    for host, cores in cpu_per_host.items():
        if len(cores) > cores[0]:
            out.append(Finding("warning", "oversubscribed", f"{len(cores)} CPU ranks share the {cores[0]} core"
                               f"{'s' if cores[0] != 1 else ''} of host {host}: each gets one thread and the run "
                               "will be slower than with fewer ranks there."))
    return out
