"""What devices exist, asked without ever initializing CUDA in the calling process.

A process that has created a CUDA context cannot fork safely, and torch caches CUDA state
at first use; so GPU questions are answered by a short-lived child process. Validation takes
a ``Probe``; tests pass their own to stand in for machines with GPUs.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

__all__ = ["Probe", "StaticProbe", "SubprocessProbe", "default_probe", "available_memory_bytes", "cpu_count"]


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


_CHILD = r"""
import json, torch
out = {"count": 0, "mem": [], "nccl": False}
if torch.cuda.is_available():
    out["count"] = torch.cuda.device_count()
    out["mem"] = [list(torch.cuda.mem_get_info(i)) for i in range(out["count"])]
    import torch.distributed as dist
    out["nccl"] = bool(dist.is_available() and dist.is_nccl_available())
print(json.dumps(out))
"""


@dataclass
class SubprocessProbe(Probe):
    """Asks a child Python process about GPUs; answers are cached for ``ttl`` seconds.

    When the installed torch has no CUDA support, no child is started at all.
    """

    ttl: float = 5.0
    _cache: Optional[tuple[float, dict]] = field(default=None, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def _info(self) -> dict:
        with self._lock:
            now = time.monotonic()
            if self._cache is not None and now - self._cache[0] < self.ttl:
                return self._cache[1]
            info = self._query()
            self._cache = (now, info)
            return info

    @staticmethod
    def _query() -> dict:
        try:
            import torch
        except ImportError:
            return {"count": 0, "mem": [], "nccl": False}
        if torch.version.cuda is None or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
            return {"count": 0, "mem": [], "nccl": False}
        try:
            done = subprocess.run(
                [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120, check=True
            )
            return json.loads(done.stdout.strip().splitlines()[-1])
        except (subprocess.SubprocessError, ValueError, IndexError, OSError):
            return {"count": 0, "mem": [], "nccl": False}

    def cuda_count(self) -> int:
        return int(self._info()["count"])

    def cuda_free_memory(self, index: int) -> tuple[int, int]:
        free, total = self._info()["mem"][index]
        return int(free), int(total)

    def nccl_available(self) -> bool:
        return bool(self._info()["nccl"])


_default: Optional[Probe] = None


def default_probe() -> Probe:
    """The process-wide CUDA-safe probe."""
    global _default
    if _default is None:
        _default = SubprocessProbe()
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
