"""Which ipyparallel engines a run uses, and what validation learns from them.

When one machine is not enough, the same ``launch`` / ``fit`` runs on the engines of an
ipyparallel cluster: one rank per engine, in the order of the view's engine ids::

    import ipyparallel as ipp
    cluster = ipp.Cluster(n=4)             # or a cluster started elsewhere
    rc = cluster.start_and_connect_sync()
    result = ddp_notebook.fit(model, data, engines=rc)          # cpu on every engine
    result = ddp_notebook.fit(model, data, engines=rc[0:2], devices="cuda:0,cuda:1")

The device list pairs with the engines: rank r runs on the r-th engine with the r-th
device (default: ``cpu`` on every engine). Every engine needs ddp_notebook and torch
installed, and must see the run directory (``run_root``), where the process group meets
(a shared file system when the engines are on several hosts). Nothing here imports
ipyparallel until a run asks for engines.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from .devices import DeviceSpec, parse_devices
from .errors import DeviceSpecError, EngineSelectionError
from .probes import Probe
from .validation import Finding, ValidationReport, validate_devices

__all__ = ["Engines", "engines_of", "EngineProbe", "validate_on_engines", "DESCRIBE_TIMEOUT"]

DESCRIBE_TIMEOUT = 30.0  # seconds an engine may take to answer before validation reports it


class Engines:
    """An ipyparallel client and the engine ids a run uses (rank r on ``ids[r]``).

    What each engine said about itself (host, GPUs, versions) is asked once, by validation,
    and kept here for the run's start."""

    def __init__(self, client: Any, ids: Sequence[int]) -> None:
        self.client = client
        self.ids = tuple(int(i) for i in ids)
        self._info: Optional[list[dict]] = None

    def describe(self, timeout: float = DESCRIBE_TIMEOUT) -> list[dict]:
        """``describe_engine()`` of every engine, in rank order (``{"error": ...}`` for one
        that cannot answer)."""
        if self._info is None:
            from ._engine_worker import describe_engine

            pending = []
            for eid in self.ids:
                try:
                    pending.append(self.client[eid].apply_async(describe_engine))
                except Exception as e:  # noqa: BLE001 - ipyparallel refuses unknown ids at once
                    pending.append(e)
            info = []
            for eid, ar in zip(self.ids, pending):
                info.append(_answer(eid, ar, timeout))
            self._info = info
        return self._info

    def subset(self, ranks: Sequence[int]) -> "Engines":
        """The engines of the given ranks (for a retry), with what is known of them."""
        out = Engines(self.client, [self.ids[r] for r in ranks])
        if self._info is not None:
            out._info = [self._info[r] for r in ranks]
        return out

    def hosts(self) -> list[str]:
        return [i.get("host", "?") for i in self.describe()]

    def __len__(self) -> int:
        return len(self.ids)

    def __repr__(self) -> str:
        return f"Engines({list(self.ids)})"


def _answer(eid: int, ar: Any, timeout: float) -> dict:
    if isinstance(ar, Exception):
        return {"error": f"engine {eid} is not available: {ar}"}
    try:
        return dict(ar.get(timeout=timeout))
    except Exception as e:  # noqa: BLE001 - RemoteError, TimeoutError, EngineError
        ename = getattr(e, "ename", type(e).__name__)
        if ename == "TimeoutError":
            return {"error": f"engine {eid} did not answer within {timeout:.0f} s (busy with another task?)"}
        evalue = getattr(e, "evalue", str(e))
        return {"error": f"engine {eid} could not describe itself ({ename}: {evalue}); is ddp_notebook "
                         "installed in the engine's environment?"}


def engines_of(obj: Any) -> Engines:
    """Engines from an ipyparallel ``Client`` (all its engines), a ``DirectView``
    (``rc[0:2]``, its targets), or an ``Engines``."""
    if isinstance(obj, Engines):
        return obj
    client = getattr(obj, "client", None)
    if client is not None and hasattr(obj, "targets"):  # a view
        targets = obj.targets
        if targets is None or targets == "all":
            ids = list(client.ids)
        elif isinstance(targets, int):
            ids = [targets]
        else:
            ids = list(targets)
        return Engines(client, ids)
    if hasattr(obj, "ids") and hasattr(obj, "load_balanced_view"):  # a Client
        return Engines(obj, list(obj.ids))
    raise EngineSelectionError(
        f"engines= takes an ipyparallel Client (every engine) or a DirectView such as rc[0:2], "
        f"not {type(obj).__name__}")


class EngineProbe(Probe):
    """Answers validation's questions from what the engines said (the most limited engine
    counts: a device list must fit on every engine that runs it)."""

    def __init__(self, info: Sequence[dict]) -> None:
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
_PER_MACHINE = ("duplicate", "missing", "oversubscribed")


def validate_on_engines(spec: Optional[DeviceSpec], engines: Engines, *, backend: Optional[str] = None,
                        min_free_memory: Optional[int] = None, dataset_size: Optional[int] = None,
                        batch_size: Optional[int] = None, drop_last: bool = False) -> ValidationReport:
    """``validate_devices`` for a run on engines, where rank r runs on the r-th engine.

    A GPU is checked on the host of its engine: ``cuda:0,cuda:0`` is valid on two hosts and a
    duplicate on one; ``cuda:1`` must exist on the engine that gets it; CPU ranks are compared
    with the cores of their own host. Also reported: too few engines, an engine that does not
    answer or cannot import torch, another ddp_notebook version. ``spec`` None means ``cpu`` on
    every engine.

    >>> fake = Engines(None, [0, 1])
    >>> fake._info = [{"host": h, "cuda_count": 1, "cpu_count": 8, "nccl": True, "ddp_notebook": "0.1.0"}
    ...               for h in ("gpu-a", "gpu-b")]
    >>> validate_on_engines("cuda:0,cuda:0", fake).ok
    True
    """
    from . import __version__

    info = engines.describe()
    spec = f"cpu*{len(engines)}" if spec is None else spec
    # A bare "cuda" asks for every GPU; on engines that means as many as the smallest engine has.
    # Only the engines that get a rank count (the view may hold more); how many is known once
    # the spec is read, so read it with every engine first.
    try:
        count = len(parse_devices(spec, cuda_count=EngineProbe(info).cuda_count))
    except DeviceSpecError:
        count = len(info)  # validate_devices reports what is wrong with the spec
    report = validate_devices(spec, backend=backend, probe=EngineProbe(info[:count]), dataset_size=dataset_size,
                              batch_size=batch_size, drop_last=drop_last)
    findings = [f for f in report.findings if f.code not in _PER_MACHINE]
    if not engines.ids:
        findings.append(Finding("error", "engines", "The view has no engines: start some (ipcluster start -n 2, "
                                "or ipyparallel.Cluster(n=2).start_and_connect_sync())."))
    elif len(report.devices) > len(engines):
        findings.append(Finding("error", "engines", f"{len(report.devices)} devices for {len(engines)} engine"
                                f"{'s' if len(engines) != 1 else ''} (ids {', '.join(map(str, engines.ids))}): "
                                "each engine runs one rank; list fewer devices or start more engines."))
    placed = list(zip(engines.ids, info, report.devices))
    for eid, i, _device in placed:
        if "error" in i:
            findings.append(Finding("error", "engine", i["error"]))
        elif "torch_error" in i:
            findings.append(Finding("error", "engine", f"engine {eid} cannot import torch: {i['torch_error']}"))
        elif i.get("ddp_notebook") != __version__:
            findings.append(Finding("warning", "version", f"engine {eid} has ddp_notebook {i.get('ddp_notebook')}, "
                                    f"this notebook {__version__}: install the same version on every engine."))
    findings += _placement_findings([(rank, eid, i, d) for rank, (eid, i, d) in enumerate(placed)
                                     if "error" not in i and "torch_error" not in i])
    if min_free_memory is not None:
        findings.append(Finding("warning", "memory", "min_free_memory is not checked on engines."))
    return ValidationReport(report.spec, report.devices, report.backend, tuple(findings))


def _physical_gpu(info: dict, index: int) -> str:
    """What tells GPUs of one host apart: the visible-devices entry an engine's cuda:N maps to."""
    visible = [v.strip() for v in (info.get("cuda_visible") or "").split(",") if v.strip()]
    return visible[index] if index < len(visible) else str(index)


def _placement_findings(placed: list) -> list[Finding]:
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
    for _rank, eid, i, d in placed:
        if d.kind == "cpu":
            cpu_per_host.setdefault(i.get("host", "?"), []).append(int(i.get("cpu_count", 1)))
    for host, cores in cpu_per_host.items():
        if len(cores) > cores[0]:
            out.append(Finding("warning", "oversubscribed", f"{len(cores)} CPU ranks share the {cores[0]} core"
                               f"{'s' if cores[0] != 1 else ''} of host {host}: each gets one thread and the run "
                               "will be slower than with fewer ranks there."))
    return out
