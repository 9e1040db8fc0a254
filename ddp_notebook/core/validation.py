"""Checks a device list before anything starts and reports every problem at once.

Pure logic over a :class:`~ddp_notebook.core.probes.Probe`; tests inject a ``StaticProbe``.

>>> from ddp_notebook.core.probes import StaticProbe
>>> report = validate_devices("cuda:0,cuda:1", probe=StaticProbe(gpus_free=[(1 << 34, 1 << 35)]))
>>> report.ok
False
>>> print(report.errors[0].message)
cuda:1 does not exist: 1 CUDA device is visible (cuda:0).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

from .devices import Device, DeviceSpec, format_devices, parse_devices
from .errors import DeviceSpecError, InvalidDevicesError
from .probes import Probe, default_probe

__all__ = ["Finding", "ValidationReport", "InvalidDevicesError", "validate_devices", "choose_backend", "BACKENDS",
           "shard_sizes", "shard_problem"]

BACKENDS = ("gloo", "nccl")
# Each CPU worker is a process of its own with torch loaded: beyond this many per core a run only
# thrashes (and "cpu*1024" is a typo, not a plan).
CPU_WORKERS_PER_CORE = 4


@dataclass(frozen=True)
class Finding:
    """One problem found: ``level`` is ``"error"`` or ``"warning"``; ``code`` a stable name."""

    level: str
    """``"error"`` (the list cannot run) or ``"warning"`` (it can, but should not)."""
    code: str
    """A stable name of the problem: argument, syntax, empty, duplicate, missing, memory, mixed,
    backend, oversubscribed, too_many, empty_shard (and, on engines, what the engines' checks find)."""
    message: str
    """What is wrong, in a sentence that names the bad value and what is valid."""
    device: Optional[str] = None
    """The device it is about, if one."""


@dataclass(frozen=True)
class ValidationReport:
    """The result of validating a device list: the devices, the backend and the findings."""

    spec: str
    """The device list as given (as text)."""
    devices: tuple[Device, ...]
    """The devices read from it, in rank order (empty when it could not be read)."""
    backend: Optional[str]
    """The backend the run would use, ``"gloo"`` or ``"nccl"``."""
    findings: tuple[Finding, ...] = field(default=())
    """Every problem found, errors and warnings."""

    @property
    def errors(self) -> list[Finding]:
        """The findings that stop a launch."""
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        """The findings a launch goes on with (the run starts all the same)."""
        return [f for f in self.findings if f.level == "warning"]

    @property
    def ok(self) -> bool:
        """True when there is no error: ``launch`` would start."""
        return not self.errors

    def summary(self) -> str:
        """One paragraph: what is wrong, for exception messages."""
        if self.ok:
            return f"devices {format_devices(self.devices)} are valid ({self.backend})"
        messages = (f.message.rstrip() for f in self.errors)
        problems = " ".join(m if m.endswith((".", "!", "?")) else m + "." for m in messages)
        return f"invalid device list {self.spec!r}: {problems}"

    def __str__(self) -> str:
        lines = [f"Device list {self.spec!r}: " + ("OK" if self.ok else f"{len(self.errors)} error(s)")]
        if self.devices:
            ranks = ", ".join(
                f"rank {r} = {d}" + (" (main)" if r == 0 else "") for r, d in enumerate(self.devices)
            )
            lines.append(f"  {ranks}; backend {self.backend or '?'}")
        for f in self.findings:
            lines.append(f"  {f.level.upper():7} {f.message}")
        return "\n".join(lines)


def choose_backend(devices: Sequence[Device]) -> str:
    """nccl for an all-CUDA list, gloo otherwise."""
    return "nccl" if devices and all(d.kind == "cuda" for d in devices) else "gloo"


def _gib(n: int) -> str:
    """Bytes as people read them: 512 B, 3.0 MiB, 1.5 GiB."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} GiB"  # pragma: no cover


def _spec_text(spec: DeviceSpec) -> str:
    if isinstance(spec, str):
        return spec
    if isinstance(spec, (list, tuple)):
        return ",".join(str(s) for s in spec) if spec else repr(spec)  # an empty list is named as given
    return str(spec)


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _argument_problems(min_free_memory: Any, probe: Any, dataset_size: Any, batch_size: Any,
                       drop_last: Any) -> list[str]:
    """What is wrong with validate_devices' own arguments (the device list aside), one message each."""
    problems = []
    for name, value, least, unit in (("min_free_memory", min_free_memory, 0, " of bytes"),
                                     ("dataset_size", dataset_size, 0, " of samples"),
                                     ("batch_size", batch_size, 1, "")):
        if value is not None and (not _whole(value) or value < least):
            problems.append(f"{name} must be a whole number{unit} >= {least} or None, not {value!r}.")
    if probe is not None and not isinstance(probe, Probe):
        problems.append(f"probe must be a ddp_notebook Probe (such as StaticProbe(cpus=4)) or None, not {probe!r}.")
    if not isinstance(drop_last, bool):
        problems.append(f"drop_last must be True or False, not {drop_last!r}.")
    return problems


def validate_devices(
    spec: DeviceSpec,
    *,
    backend: Optional[str] = None,
    min_free_memory: Optional[int] = None,
    probe: Optional[Probe] = None,
    dataset_size: Optional[int] = None,
    batch_size: Optional[int] = None,
    drop_last: bool = False,
) -> ValidationReport:
    """Validate a device list; never raises for bad input, the report says what is wrong.

    ``min_free_memory`` is the bytes each worker needs free on its device (host memory for
    CPU workers). ``backend`` defaults to nccl for all-CUDA lists and gloo otherwise. With
    ``dataset_size`` and ``batch_size``, a rank whose data shard would yield no batch is an error.
    An unusable keyword argument is an ``argument`` error of the report, like a bad device list.
    """
    text = _spec_text(spec)
    findings: list[Finding] = []
    problems = _argument_problems(min_free_memory, probe, dataset_size, batch_size, drop_last)
    if problems:
        findings = [Finding("error", "argument", message) for message in problems]
        return ValidationReport(text, (), None, tuple(findings))
    probe = probe or default_probe()

    def err(code: str, message: str, device: Optional[Device] = None) -> None:
        findings.append(Finding("error", code, message, str(device) if device else None))

    def warn(code: str, message: str, device: Optional[Device] = None) -> None:
        findings.append(Finding("warning", code, message, str(device) if device else None))

    try:
        devices = parse_devices(spec, cuda_count=probe.cuda_count)
    except DeviceSpecError as e:
        err("syntax", str(e))
        return ValidationReport(text, (), backend, tuple(findings))

    if not devices:
        err("empty", "The device list is empty: give at least one device, e.g. 'cpu:0,cpu:1' or 'cuda:0'.")
        return ValidationReport(text, (), backend, tuple(findings))

    ranks: dict[Device, list[int]] = defaultdict(list)
    for rank, d in enumerate(devices):
        ranks[d].append(rank)
    for d, rs in ranks.items():
        if len(rs) > 1:
            err("duplicate", f"{d} is listed {len(rs)} times (ranks {', '.join(map(str, rs))}); "
                "each device may appear once.", d)

    kinds = sorted({d.kind for d in devices})
    if len(kinds) > 1:
        err("mixed", f"The list mixes device kinds ({', '.join(kinds)}); all workers of a run "
            "must use one kind so that they share one backend.")

    chosen = backend if backend is not None else choose_backend(devices)
    if not isinstance(chosen, str) or chosen not in BACKENDS:
        err("backend", f"Unknown backend {chosen!r}; valid backends are {', '.join(BACKENDS)}.")
    elif chosen == "nccl" and any(d.kind != "cuda" for d in devices):
        err("backend", "The nccl backend needs CUDA devices only; use backend='gloo' for CPU workers.")

    cuda = [d for d in dict.fromkeys(devices) if d.kind == "cuda"]
    if cuda:
        count = probe.cuda_count()
        visible = ", ".join(f"cuda:{i}" for i in range(count))
        # What would run here instead: as many CPU workers as the list asked for (two at least, for
        # DDP), within the cores.
        instead = f"cpu*{max(1, min(max(2, len(devices)), probe.cpu_count()))}"
        if count == 0:  # one finding for the list, not the same sentence per device
            names = ", ".join(map(str, cuda))
            err("missing", f"{names} {'does' if len(cuda) == 1 else 'do'} not exist: no CUDA device is visible "
                f"here (no GPU, a CPU-only torch, or CUDA_VISIBLE_DEVICES is empty); {instead} runs on this "
                "machine's CPU.", cuda[0] if len(cuda) == 1 else None)
        for d in cuda:
            if d.index >= count:
                if count:
                    err("missing", f"{d} does not exist: {count} CUDA device{'s are' if count > 1 else ' is'} "
                        f"visible ({visible}).", d)
            elif min_free_memory is not None:
                free, total = probe.cuda_free_memory(d.index)
                if free < min_free_memory:
                    err("memory", f"{d} has {_gib(free)} free of {_gib(total)}; each worker needs "
                        f"{_gib(min_free_memory)}.", d)
        if chosen == "nccl" and count and not probe.nccl_available():
            err("backend", "This torch has no NCCL support; use backend='gloo'.")

    cpu = [d for d in dict.fromkeys(devices) if d.kind == "cpu"]
    if cpu:
        cores = max(1, probe.cpu_count())
        if len(cpu) > CPU_WORKERS_PER_CORE * cores:
            most = CPU_WORKERS_PER_CORE * cores
            err("too_many", f"{len(cpu)} CPU workers are too many for {cores} core{'s' if cores != 1 else ''}: at most "
                f"{most} ({CPU_WORKERS_PER_CORE} per core) can run here, each a process with torch loaded; "
                f"one per core (cpu*{cores}) is the fastest.")
        elif len(cpu) > cores:
            warn("oversubscribed", f"{len(cpu)} CPU workers share {cores} core{'s' if cores != 1 else ''}: "
                 "each worker gets one thread and the run will be slower than with fewer workers.")
        if min_free_memory is not None:
            avail = probe.host_available_memory()
            need = min_free_memory * len(cpu)
            if avail is not None and avail < need:
                err("memory", f"{len(cpu)} CPU workers need {_gib(need)} of host memory and "
                    f"{_gib(avail)} is available.")

    if dataset_size is not None and batch_size is not None:
        problem = shard_problem(len(devices), dataset_size, batch_size, drop_last)
        if problem is not None:
            findings.append(Finding("error", "empty_shard", problem))
    return ValidationReport(text, tuple(devices), chosen, tuple(findings))


def shard_sizes(n_samples: int, world_size: int, batch_size: int, drop_last: bool = False) -> list[tuple[int, int]]:
    """(samples, batches) each rank gets from a ``DistributedSampler`` + ``DataLoader``.

    Without drop_last the sampler pads the shards to equal size (repeating samples), so every
    rank of a non-empty dataset gets at least one batch; with drop_last both the sampler and the
    loader drop the remainder.

    >>> shard_sizes(100, 2, 64, drop_last=True)
    [(50, 0), (50, 0)]
    >>> shard_sizes(100, 3, 16)
    [(34, 3), (34, 3), (34, 3)]
    """
    if n_samples <= 0:
        return [(0, 0)] * world_size
    per_rank = n_samples // world_size if drop_last else -(-n_samples // world_size)
    batches = per_rank // batch_size if drop_last else -(-per_rank // batch_size)
    return [(per_rank, batches)] * world_size


def shard_problem(world_size: int, n_samples: int, batch_size: int, drop_last: bool = False,
                  what: str = "training data") -> Optional[str]:
    """What is wrong when the ranks' shards would yield no batch, in one message (every rank's
    shard has the same size), else None.

    >>> shard_problem(2, 100, 64, drop_last=True).split(": ")[0]
    'Each of the 2 workers would get 0 batches of training data'
    >>> shard_problem(2, 100, 64) is None
    True
    """
    if batch_size < 1:
        return f"batch_size must be at least 1, not {batch_size}."
    if n_samples <= 0:
        return f"The {what} is empty: give at least one sample."
    samples, batches = shard_sizes(n_samples, world_size, batch_size, drop_last)[0]
    if batches:
        return None
    fixes = [f"batch_size <= {max(samples, 1)}", "drop_last=False"] + (["fewer devices"] if world_size > 1 else [])
    who = f"Each of the {world_size} workers" if world_size > 1 else "The worker"
    return (f"{who} would get 0 batches of {what}: {n_samples} samples over {world_size} "
            f"worker{'s' if world_size > 1 else ''} is {samples} per worker, fewer than batch_size {batch_size} "
            f"with drop_last=True. Use {', or '.join(fixes)}.")
