"""Every worker process is started from one thread that lives as long as the notebook process.

A worker asks the OS to kill it when its parent dies (``PR_SET_PDEATHSIG``, see
``worker.boot.tie_to_parent``), and to Linux the parent is the *thread* that started it: a worker
started from a thread that then ends would be killed with that thread. Workers are started from
short-lived threads (a run's supervisor refills the pool as it finishes; a user may call
``launch`` from a thread of their own), so every ``Popen`` of a worker runs here instead.
"""
from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Optional, TypeVar

__all__ = ["in_spawner_thread"]

T = TypeVar("T")
_NAME = "ddp-spawner"
_Job = tuple[Callable[[], Any], "Future[Any]"]


class _Spawner:
    """One daemon thread that runs the jobs handed to it, one at a time, and never ends."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: Optional[queue.SimpleQueue[_Job]] = None
        self._pid = 0

    def jobs(self) -> queue.SimpleQueue[_Job]:
        with self._lock:
            # Started on first use; again in a forked copy of the notebook process (fork copies
            # only the thread that forked).
            if self._jobs is None or self._pid != os.getpid():
                self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
                threading.Thread(target=_serve, args=(self._jobs,), name=_NAME, daemon=True).start()
            return self._jobs


def _serve(jobs: queue.SimpleQueue[_Job]) -> None:
    while True:
        job, future = jobs.get()
        try:
            future.set_result(job())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
            future.set_exception(exc)


_spawner = _Spawner()


def in_spawner_thread(start: Callable[[], T], undo: Callable[[T], None]) -> T:
    """``start()`` run in the spawner thread: its result, or what it raised. An interrupt of the
    waiting thread (KeyboardInterrupt) is raised once ``start`` is done, after ``undo`` of its
    result: what was started is never lost."""
    if threading.current_thread().name == _NAME:  # already there (a job that starts another)
        return start()
    future: Future[T] = Future()
    _spawner.jobs().put((start, future))
    interrupted: Optional[KeyboardInterrupt] = None
    while True:
        try:
            result = future.result()
        except KeyboardInterrupt as exc:
            if future.done():
                raise
            interrupted = exc  # the wait was interrupted: wait on, then undo
            continue
        break
    if interrupted is not None:
        undo(result)
        raise interrupted
    return result
