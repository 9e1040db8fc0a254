"""A worker forked by the fork server, as the supervisor sees it, and what makes a server stale.

Split from ``forkserver`` (the server's lifecycle): the ``ProcessHandle`` of a forked worker, how
its exit is known (the server's report, or the zombie's own status in ``/proc`` when the server
cannot answer), and the state of the notebook process a server captured when it started.
"""
from __future__ import annotations

import os
import signal
import site
import subprocess
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Optional

__all__ = ["ForkedProcess", "READ_AT_IMPORT", "READ_LATER", "staleness", "process_state"]

# Variables that torch, its libraries or Python read when torch is imported: the server's copy was
# read when it started, so a change in the notebook replaces the server. Others are read later,
# and each worker gets the notebook's environment as it is at launch.
READ_AT_IMPORT = ("TORCH", "PYTORCH", "CUDA", "NCCL", "GLOO", "OMP_", "MKL", "KMP_", "OPENBLAS", "GOTO",
                  "LD_", "PYTHON", "NVIDIA", "HIP", "ROCM", "HSA_", "CUBLAS", "CUDNN", "XLA", "DNNL", "ONEDNN")
# Names with those prefixes that torch reads only when it is called, which the frameworks set as they
# are imported (Lightning: the NVML check; the inductor's cache folder): a worker gets them at
# launch, and a server replaced for them would cost the first framework launch a new server.
READ_LATER = frozenset({"PYTHONUNBUFFERED", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR"})


def _site_dirs() -> list[str]:
    dirs = list(getattr(site, "getsitepackages", list)())
    user = getattr(site, "getusersitepackages", lambda: None)()
    return dirs + ([user] if isinstance(user, str) else [])


def staleness(set_by_imports: Optional[dict[str, str]] = None) -> tuple[Any, ...]:
    """What a server must share with the notebook process to fork its workers: the variables read
    at import (``READ_AT_IMPORT``), and the installed packages (a site-packages folder changes when
    ``pip`` installs, upgrades or removes one: the server may hold the old version imported). A
    variable with the value the server's own imports gave it (``set_by_imports``) is left out."""
    made = set_by_imports or {}
    env = tuple(sorted((k, v) for k, v in os.environ.items()
                       if k.startswith(READ_AT_IMPORT) and k not in READ_LATER and made.get(k) != v))
    folders: list[tuple[str, Optional[int]]] = []
    for folder in _site_dirs():
        try:
            folders.append((folder, os.stat(folder).st_mtime_ns))
        except OSError:
            folders.append((folder, None))
    return env, tuple(folders)


def process_state() -> dict[str, Any]:
    """What a forked worker takes from the notebook process as it is at launch, besides the
    environment, directory and path that every worker gets: its umask, resource limits and CPU
    affinity (a fresh interpreter inherits them; a forked one would have the server's)."""
    import resource  # POSIX only: the fork server's platforms

    mask = os.umask(0o077)
    os.umask(mask)
    limits = {name: resource.getrlimit(getattr(resource, name)) for name in dir(resource)
              if name.startswith("RLIMIT_")}
    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"umask": mask, "rlimits": limits, "affinity": affinity}


def _zombie_status(pid: int, parent: int) -> Optional[int]:
    """The exit status (``Popen``'s convention) of ``pid`` if it has exited and awaits its reap by
    ``parent``, read from ``/proc/PID/stat`` (Linux 3.5+): known without the server. None while
    it runs, and once it is another's child: its server died, and that death is its cause."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] != b"Z" or len(fields) < 50 or int(fields[1]) != parent:
        return None
    status = int(fields[49])
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class ForkedProcess:
    """A worker the server forked (a ``ProcessHandle``): its exit is reported by the server, which
    keeps it a zombie until ``wait`` collects it, as the OS does for a ``Popen`` child. A server
    that cannot answer (stopped by a debugger) holds nothing up: the zombie says how it ended."""

    def __init__(self, reap: Callable[[int], None], pid: int, out_fd: int, err_fd: int, server: int) -> None:
        self.pid = pid
        self.server = server  # its parent while the server lives
        self.stdout: IO[bytes] = open(out_fd, "rb", buffering=0)
        self.stderr: IO[bytes] = open(err_fd, "rb", buffering=0)
        self.returncode: Optional[int] = None
        self.lost: Optional[str] = None
        self._reap = reap
        self._status: Optional[int] = None
        self._exit = threading.Event()
        self._lock = threading.Lock()

    def exited(self, rc: int, lost: Optional[str] = None) -> None:
        """The server reported the exit (or died: ``lost`` says so, unless the exit came first)."""
        if self._exit.is_set():
            return
        self.lost = lost
        self._status = rc
        self._exit.set()

    def reported(self) -> bool:
        return self._exit.is_set()

    def ended(self) -> bool:
        # Gone from /proc altogether: its server died and init collected it (the report follows).
        return (self._exit.is_set() or _zombie_status(self.pid, self.server) is not None
                or not os.path.exists(f"/proc/{self.pid}"))

    def poll(self) -> Optional[int]:
        return self.wait(0) if self.ended() else None

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._exit.wait(0.05 if deadline is None else max(0.0, min(0.05, deadline - time.monotonic()))):
            status = _zombie_status(self.pid, self.server)
            if status is not None:
                self.exited(status)
            elif deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(["ddp-worker", str(self.pid)], timeout or 0)
        with self._lock:
            if self.returncode is None:
                assert self._status is not None
                self.returncode = self._status
                self._reap(self.pid)
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None and self.lost is None:  # a lost one's pid may be another's by now
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
