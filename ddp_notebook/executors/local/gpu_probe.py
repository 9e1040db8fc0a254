"""The CUDA-safe probe of this machine: GPU questions answered by a short-lived child process, so
that the notebook never initialises CUDA (a process with a CUDA context cannot fork safely, and
torch caches CUDA state at first use). When the installed torch has no CUDA support, no child is
started at all.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from ...core.probes import Probe

__all__ = ["SubprocessProbe"]


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


def _torch_build() -> dict[str, object]:
    """What the installed torch was built for (``torch/version.py``: ``cuda``, ``hip``), read
    without importing torch: the probe runs on a panel's thread too, and a second thread importing
    torch while the notebook's main thread does gets it half imported ({} without torch)."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return {}
    folder = os.path.dirname(spec.origin) if spec is not None and spec.origin else None
    if folder is None:
        return {}
    found: dict[str, object] = {}
    try:
        with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, SyntaxError, ValueError):
        return {}
    for node in tree.body:  # ``cuda: Optional[str] = '12.1'`` and the like: constants only
        target, value = (node.target, node.value) if isinstance(node, ast.AnnAssign) else \
            (node.targets[0], node.value) if isinstance(node, ast.Assign) and len(node.targets) == 1 else (None, None)
        if isinstance(target, ast.Name) and isinstance(value, ast.Constant):
            found[target.id] = value.value
    return found


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
        built = _torch_build()
        if not (built.get("cuda") or built.get("hip")) or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
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
