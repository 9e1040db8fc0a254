"""A run's ranks as ``torch.multiprocessing`` shows its children: code written for
``ProcessContext.processes`` (``p.pid``, ``p.is_alive()``, ``p.exitcode``, ``p.join()``) keeps
working on ``Run.processes``.

Example::

    run = ddp_notebook.spawn(train, args=(2,), nprocs=2, join=False)
    [p.pid for p in run.processes]
    while not run.join(timeout=1.0):
        print([p.is_alive() for p in run.processes])
"""
from __future__ import annotations

import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any, Optional

from ..core.errors import WaitTimeoutError, WorkerFailedError
from ..core.events import EventKind
from ..core.failures import FailureKind, WorkerFailure
from ..core.state import RunState, WorkerState
from .options import check_seconds

__all__ = ["AsProcesses", "WorkerProcess", "echo_output", "process_failure"]


def echo_output(event: dict[str, Any]) -> None:
    """Print a rank's output event here, each line marked with its rank as torchrun marks them
    (``[rank1]:...``), to stdout or stderr as the rank wrote it (a run's subscriber)."""
    if event.get("kind") != EventKind.OUTPUT:
        return
    out = sys.stderr if event.get("stream") == "stderr" else sys.stdout
    mark = f"[rank{event.get('rank')}]:"
    # A progress bar redrawn with carriage returns stays one line here too (each redraw marked).
    text = str(event.get("text", ""))
    if not text:
        return
    out.write("".join(mark + line.rstrip("\r").replace("\r", "\r" + mark) + "\n"
                      for line in text.rstrip("\n").split("\n")))
    out.flush()


def process_failure(failure: WorkerFailure, failures: Sequence[WorkerFailure],
                    run_dir: Optional[str] = None) -> WorkerFailedError:
    """The ``WorkerFailedError`` of a spawn run, which is also what ``torch.multiprocessing.spawn``
    raises (``ProcessRaisedException`` for a raise, ``ProcessExitedException`` for an exit or a
    signal), so code that catches torch's types catches it; ``error_index`` is the failed rank."""
    from torch.multiprocessing.spawn import ProcessExitedException, ProcessRaisedException

    raised = failure.kind == FailureKind.EXCEPTION
    cls = _torch_flavoured(ProcessRaisedException if raised else ProcessExitedException)
    error = cls(failure, failures, run_dir)
    error.msg, error.error_index, error.error_pid = failure.headline(), failure.rank, failure.pid
    if not raised:
        error.exit_code, error.signal_name = failure.exit_code, failure.signal
    return error


@functools.cache
def _torch_flavoured(torch_type: type) -> type:
    def __reduce__(self: WorkerFailedError) -> Any:  # torch's own takes other arguments
        return WorkerFailedError, (self.failure, self.failures, self.run_dir)

    return type(f"WorkerFailedError_{torch_type.__name__}", (WorkerFailedError, torch_type),
                {"__reduce__": __reduce__, "__module__": WorkerFailedError.__module__})


class WorkerProcess:
    """One rank, read from the run's state as it is now; ``terminate()`` and ``kill()`` stop the
    whole run (one rank cannot go on without its peers)."""

    def __init__(self, rank: int, state: Callable[[], WorkerState], ended: threading.Event,
                 stop: Callable[[float], None]) -> None:  # (stop: the run's, with a grace of 0 s)
        self.rank = rank
        self._state = state
        self._ended = ended
        self._stop = stop

    @property
    def name(self) -> str:
        return f"rank {self.rank} ({self._state().label})"

    @property
    def pid(self) -> Optional[int]:
        return self._state().pid

    @property
    def exitcode(self) -> Optional[int]:
        """The exit status once the rank's process has ended (negative: the signal), else None."""
        worker = self._state()
        return worker.exit_code if worker.ended_at is not None else None

    def is_alive(self) -> bool:
        return self._state().ended_at is None and not self._ended.is_set()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait until the run has ended (its ranks leave together), at most ``timeout`` seconds."""
        self._ended.wait(timeout)

    def terminate(self) -> None:
        self._stop(0.0)

    kill = terminate

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name} pid={self.pid} {'alive' if self.is_alive() else 'ended'}>"


class AsProcesses:
    """What callers of ``torch.multiprocessing.spawn(..., join=False)`` use of its
    ``ProcessContext``, on a ``Run``: ``join()``, ``processes``, ``pids()``."""

    devices: list[Any]
    _finished: threading.Event

    def wait(self, timeout: Optional[float] = None) -> Any:
        raise NotImplementedError

    def stop(self, grace: Optional[float] = None, wait: bool = False) -> None:
        raise NotImplementedError

    @property
    def state(self) -> RunState:
        raise NotImplementedError

    def join(self, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> bool:
        """As ``ProcessContext.join``: True once the run has ended well, False while it still runs
        after ``timeout`` seconds; a failure raises as ``wait()`` does. (``grace_period`` is taken
        for the same calls and not needed: ``kill_grace`` says how long a failed run's peers get.)"""
        check_seconds("grace_period", grace_period, positive=False, optional=True)
        try:
            self.wait(timeout)
        except WaitTimeoutError:
            return False
        return True

    @property
    def processes(self) -> list[WorkerProcess]:
        """The ranks as ``torch.multiprocessing`` shows its children (``pid``, ``is_alive()``...)."""
        return [WorkerProcess(rank, functools.partial(self._worker, rank), self._finished, self.stop)
                for rank in range(len(self.devices))]

    def pids(self) -> list[Optional[int]]:
        """The ranks' process ids (None for a rank not started yet)."""
        return [p.pid for p in self.processes]

    def _worker(self, rank: int) -> WorkerState:
        return self.state.workers[rank]
