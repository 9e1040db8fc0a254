"""A run whose workers wait for the fork server: ``launch`` returns at once, the ranks start later.

The first launch of a notebook process (without ``%load_ext``, which starts the server ahead)
finds the fork server still importing torch. Rather than hold the kernel until it is ready, the
run starts at once and its ranks are forked by the supervisor's thread, at its first ``poll``;
until then the panel shows them starting. What the supervisor asks of the ranks before they exist
is kept and applied to them, in order, the moment they do.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Optional

from ..base import Observation, Transport
from .transport import LocalTransport

__all__ = ["DeferredTransport"]


class DeferredTransport(Transport):
    """A ``LocalTransport`` made by ``start`` when the supervisor first polls."""

    def __init__(self, start: Callable[[], LocalTransport]) -> None:
        self._start = start
        self._inner: Optional[LocalTransport] = None
        self._held: list[tuple[str, tuple[int, ...]]] = []
        self._abandoned = False
        self._lock = threading.Lock()

    def poll(self, timeout: float) -> list[Observation]:
        if self._inner is None:
            inner = self._start()  # waits for the server (it imports torch), then forks
            with self._lock:
                self._inner = inner
                held, self._held = self._held, []
                abandoned = self._abandoned
            for name, ranks in held:
                getattr(inner, name)(ranks)
            if abandoned:
                inner.abandon()
            return inner.poll(0)
        return self._inner.poll(timeout)

    def _request(self, name: str, ranks: Sequence[int]) -> None:
        with self._lock:
            if self._inner is None:
                self._held.append((name, tuple(ranks)))
                return
            inner = self._inner
        getattr(inner, name)(ranks)

    def settle(self, silent: Sequence[int]) -> list[Observation]:
        return self._inner.settle(silent) if self._inner is not None else []

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
            inner = self._inner
        if inner is not None:
            inner.abandon()

    def close(self) -> None:
        if self._inner is not None:
            self._inner.close()
