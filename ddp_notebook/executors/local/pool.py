"""A pool of warm worker processes: interpreters that have imported torch and wait for a run.

Starting a worker costs an interpreter and ``import torch`` (about 1.5 s per worker on a small
machine, and the ranks start together). The pool pays that ahead: ``%load_ext ddp_notebook``
warms it, and after each run it is refilled to that run's size. Isolation is kept by using
each process once: a run's workers exit when it ends (failed, stopped or not), so nothing of a
run (weights, CUDA memory, a process group, a peer stuck in a collective) reaches the next one.
Pooled processes never touch CUDA, and exit when the notebook process ends (their control
pipe closes).

>>> from ddp_notebook import pool
>>> pool.enable(2)        # doctest: +SKIP
>>> pool.status()         # doctest: +SKIP
{'enabled': True, 'size': 2, 'idle': 2}
"""
from __future__ import annotations

import select
import threading
import time
from typing import Optional

from ...core.errors import LaunchOptionError
from ...core.probes import cpu_count
from ...core.validation import CPU_WORKERS_PER_CORE
from .processes import Prestarted, spawn_process

__all__ = ["WorkerPool", "get_pool", "enable", "disable", "status", "max_size"]


class WorkerPool:
    """Idle warm processes, taken by runs and refilled when runs end."""

    def __init__(self) -> None:
        self.enabled = False
        self.size = 0
        self._idle: list[Prestarted] = []
        self._lock = threading.Lock()

    def warm(self, size: int) -> None:
        """Keep ``size`` idle processes (start the missing ones, end the extra ones)."""
        with self._lock:
            self.size = size
            self._drop_dead()
            extra, self._idle = self._idle[size:], self._idle[:size]
            while len(self._idle) < size:
                self._idle.append(spawn_process(pooled=True))
        for p in extra:
            p.discard()

    def take(self, n: int) -> list[Optional[Prestarted]]:
        """Up to ``n`` warm processes (None for each one missing: the caller starts it cold)."""
        with self._lock:
            self._drop_dead()
            taken, self._idle = self._idle[:n], self._idle[n:]
        return taken + [None] * (n - len(taken))

    def refill(self, size: Optional[int] = None) -> None:
        """After a run: warm the pool to ``size`` (the run's world size) when it is enabled."""
        if self.enabled:
            self.warm(size if size is not None else self.size)

    def shutdown(self) -> None:
        """End every idle process; runs in progress are not affected."""
        with self._lock:
            idle, self._idle = self._idle, []
        for p in idle:
            p.discard()

    def wait_warm(self, timeout: float = 60.0) -> bool:
        """Block until every idle process has imported torch (benchmarks and tests use this)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(p.warm() for p in self._idle):
                    return True
                fds = [p.event_fd for p in self._idle if not p.warm()]
            select.select(fds, [], [], max(0.0, min(0.5, deadline - time.monotonic())))
        return False

    def idle_pids(self) -> list[int]:
        with self._lock:
            return [p.proc.pid for p in self._idle]

    def _drop_dead(self) -> None:
        dead = [p for p in self._idle if not p.alive()]
        self._idle = [p for p in self._idle if p.alive()]
        for p in dead:
            p.discard()


_pool = WorkerPool()


def get_pool() -> WorkerPool:
    return _pool


def max_size() -> int:
    """The most warm workers the pool keeps: as many as a run may have CPU workers here."""
    return CPU_WORKERS_PER_CORE * cpu_count()


def enable(size: int = 2) -> None:
    """Turn the pool on and start ``size`` warm workers in the background (returns at once); at
    most as many as a run may have CPU workers here (``CPU_WORKERS_PER_CORE`` per core)."""
    most = max_size()
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= most:
        raise LaunchOptionError(f"the pool's size is a whole number of warm workers from 0 to {most} "
                                f"({CPU_WORKERS_PER_CORE} per core here), not {size!r}")
    _pool.enabled = True
    _pool.warm(size)


def disable() -> None:
    """Turn the pool off and end its idle workers."""
    _pool.enabled = False
    _pool.shutdown()


def status() -> dict[str, object]:
    return {"enabled": _pool.enabled, "size": _pool.size, "idle": len(_pool.idle_pids())}
