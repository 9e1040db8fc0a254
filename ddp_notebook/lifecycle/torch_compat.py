"""What code written for ``torch.multiprocessing.spawn`` sees of a run: its ranks as processes
(``Run.processes``: ``p.pid``, ``p.is_alive()``, ``p.exitcode``, ``p.join()``), its failure as
torch's exception types (``process_failure``), and its ranks' output marked as torchrun marks it
(``echo_output``).

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

from ..core.errors import WorkerFailedError
from ..core.events import EventKind
from ..core.failures import FailureKind, WorkerFailure
from ..core.state import WorkerState

__all__ = ["WorkerProcess", "echo_output", "process_failure"]


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
