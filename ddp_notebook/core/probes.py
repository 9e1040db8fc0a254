"""What devices exist: the questions validation asks of a machine (``Probe``), and fixed answers
(``StaticProbe``) for tests and for machines described from afar.

The answers for this machine come from the local executor's probe
(``executors.local.gpu_probe``), which asks a short-lived child process, so that CUDA is never
initialised in the notebook (a process with a CUDA context cannot fork safely, and torch caches
CUDA state at first use).
"""
from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

__all__ = ["Probe", "StaticProbe", "default_probe", "use_default_probe", "available_memory_bytes", "cpu_count"]


def cpu_count() -> int:
    """The cores this process may run on (its affinity mask, where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class Probe:
    """Answers what validation needs to know about the machine."""

    def cpu_count(self) -> int:
        return cpu_count()

    def cuda_count(self) -> int:
        raise NotImplementedError

    def cuda_free_memory(self, index: int) -> tuple[int, int]:
        """(free, total) bytes of GPU ``index``."""
        raise NotImplementedError

    def host_available_memory(self) -> Optional[int]:
        return available_memory_bytes()

    def nccl_available(self) -> bool:
        raise NotImplementedError


@dataclass
class StaticProbe(Probe):
    """A probe with fixed answers, for tests and for describing a remote machine.

    >>> StaticProbe(cpus=8, gpus_free=[(20 << 30, 80 << 30)]).cuda_count()
    1
    """

    cpus: int = 2
    gpus_free: Sequence[tuple[int, int]] = ()
    host_memory: Optional[int] = None
    nccl: bool = True

    def cpu_count(self) -> int:
        return self.cpus

    def cuda_count(self) -> int:
        return len(self.gpus_free)

    def cuda_free_memory(self, index: int) -> tuple[int, int]:
        return tuple(self.gpus_free[index])  # type: ignore[return-value]

    def host_available_memory(self) -> Optional[int]:
        return self.host_memory

    def nccl_available(self) -> bool:
        return self.nccl and bool(self.gpus_free)


_default: Optional[Probe] = None
_make_default: Optional[Callable[[], Probe]] = None


def use_default_probe(make: Callable[[], Probe]) -> None:
    """How the process-wide probe is made (the local executor sets its CUDA-safe one, which asks
    a child process: the core starts no process)."""
    global _make_default, _default
    _make_default, _default = make, None


def default_probe() -> Probe:
    """The process-wide probe: the one ``use_default_probe`` set up, or, before any was, a
    machine with this process's cores and no GPU."""
    global _default
    if _default is None:
        _default = _make_default() if _make_default is not None else StaticProbe(cpus=cpu_count())
    return _default


def available_memory_bytes() -> Optional[int]:
    """MemAvailable from /proc/meminfo (Linux), else None."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
