"""A run whose workers wait for the fork server: ``launch`` returns at once, the ranks start later.

The first launch of a notebook process (without ``%load_ext``, which starts the server ahead)
finds the fork server still importing torch. Rather than hold the kernel until it is ready, the
run starts at once and its ranks are forked by the supervisor's thread, at its first ``poll``;
until then the panel shows them starting. What the supervisor asks of the ranks before they exist
is kept and applied to them, in order, the moment they do; a run interrupted or abandoned before
then starts no worker at all (its ranks end as ended by the supervisor, at once).
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Optional

from ..base import Exited, Observation, Transport
from .transport import LocalTransport

__all__ = ["DeferredTransport"]


class DeferredTransport(Transport):
    """A ``LocalTransport`` made by ``start`` when the supervisor first polls."""

    def __init__(self, start: Callable[[], LocalTransport], ranks: int, waiting: Callable[[], bool],
                 within: float) -> None:
        self._start = start
        self._ranks = ranks
        self._waiting = waiting  # whether the fork server still imports torch
        self._until = time.monotonic() + within  # then start anyway (a server that never gets ready)
        self._inner: Optional[LocalTransport] = None
        self._held: list[tuple[str, tuple[int, ...]]] = []
        self._abandoned = False
        self._cancel = threading.Event()  # interrupted before any worker existed: start none
        self._cancelled = False
        self._lock = threading.Lock()

    def poll(self, timeout: float) -> list[Observation]:
        if self._inner is not None:
            return self._inner.poll(timeout)
        if self._cancelled:
            self._cancel.wait(timeout)
            return []
        if not self._cancel.is_set() and time.monotonic() < self._until and self._waiting():
            # The supervisor goes on meanwhile: a stop or interrupt is seen while the server starts.
            self._cancel.wait(min(timeout, 0.1))
            return []
        if self._cancel.is_set():
            self._cancelled = True
            return [Exited(rank, code=-signal.SIGTERM, signal="SIGTERM") for rank in range(self._ranks)]
        inner = self._start()  # forks (or, when the server cannot, starts cold workers)
        with self._lock:
            self._inner = inner
            held, self._held = self._held, []
            abandoned = self._abandoned
        for name, ranks in held:
            getattr(inner, name)(ranks)
        if abandoned:
            inner.abandon()
        return inner.poll(0)

    def _request(self, name: str, ranks: Sequence[int]) -> None:
        with self._lock:
            if self._inner is None:
                self._held.append((name, tuple(ranks)))
                if name in ("interrupt", "kill"):
                    self._cancel.set()
                return
            inner = self._inner
        getattr(inner, name)(ranks)

    def settle(self, silent: Sequence[int]) -> list[Observation]:
        return self._inner.settle(silent) if self._inner is not None else []

    def started(self) -> bool:
        return self._inner is not None

    def wake(self) -> None:
        if self._inner is not None:
            self._inner.wake()

    def request_stop(self, ranks: Sequence[int]) -> None:
        self._request("request_stop", ranks)

    def request_flush(self, ranks: Sequence[int]) -> None:
        self._request("request_flush", ranks)

    def release(self, ranks: Sequence[int]) -> None:
        self._request("release", ranks)

    def interrupt(self, ranks: Sequence[int]) -> None:
        self._request("interrupt", ranks)

    def kill(self, ranks: Sequence[int]) -> None:
        self._request("kill", ranks)

    def request_stacks(self, ranks: Sequence[int]) -> None:
        self._request("request_stacks", ranks)

    def cpu_seconds(self, ranks: Sequence[int]) -> dict[int, Optional[float]]:
        return self._inner.cpu_seconds(ranks) if self._inner is not None else {r: None for r in ranks}

    def abandon(self) -> None:
        with self._lock:
            self._abandoned = self._inner is None
            if self._abandoned:
                self._cancel.set()
            inner = self._inner
        if inner is not None:
            inner.abandon()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
