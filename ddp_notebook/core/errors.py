"""The package's exception classes: every error a user can see derives from ``DDPNotebookError``.

Their public home is ``ddp_notebook.errors``, which draws the tree and names each class there
(tracebacks and pickles say ``ddp_notebook.errors.<Name>``); the ones users catch most are importable
from ``ddp_notebook`` too. Nothing here imports torch or IPython, so the errors can be raised
from the plain core.
"""
from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Optional, Protocol

from .failures import WorkerFailure, render_failure_report
from .tracebacks import user_frames

__all__ = [
    "DDPNotebookError",
    "DeviceSpecError",
    "InvalidDevicesError",
    "FitConfigError",
    "LaunchOptionError",
    "RunLoadError",
    "NotPicklableError",
    "SharedDataError",
    "ArgumentsError",
    "WorkerFailedError",
    "SupervisionError",
    "RunStoppedError",
    "RunInterrupted",
    "WaitTimeoutError",
    "NoResultError",
    "QueueUseError",
    "ProcessGroupMismatchError",
    "WorkerTraceback",
    "NoCheckpointError",
    "PreflightError",
    "NonFiniteLossError",
    "EngineSelectionError",
    "EngineUnavailableError",
    "UnsafeRunDirError",
    "CellError",
    "SessionEndedError",
    "SessionInterrupted",
]


# How a shell draws a traceback given the frames to show (IPython's own formatter, set by the
# front end: ``ui.tracebacks``); without one, as Python prints it.
DrawTraceback = Callable[[BaseException, Optional[TracebackType]], list[str]]
_draw: Optional[DrawTraceback] = None


def draw_tracebacks_with(draw: Optional[DrawTraceback]) -> None:
    """Set how ``DDPNotebookError._render_traceback_`` draws (the front end calls this once)."""
    global _draw
    _draw = draw


class DDPNotebookError(Exception):
    """Base class of every error raised by ddp_notebook."""

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing every frame: a mistake in a call (a bad device
        # list, an option) reads as the user's call and the message, without this package's frames.
        frames = user_frames(self.__traceback__)
        if _draw is not None:
            return _draw(self, frames)
        return "".join(traceback.format_exception(type(self), self, frames)).rstrip("\n").split("\n")


class DeviceSpecError(DDPNotebookError, ValueError):
    """A device list could not be read (bad syntax, unknown device kind, bad index)."""


class Report(Protocol):
    """What ``InvalidDevicesError`` holds: a ``core.validation.ValidationReport`` (named here by
    what this module uses of it, so that errors, which validation raises, need not import it)."""

    def summary(self) -> str: ...


class InvalidDevicesError(DDPNotebookError, ValueError):
    """A device list failed validation; nothing was started. ``report`` (a ``ValidationReport``)
    holds every finding, errors and warnings."""

    def __init__(self, report: Report) -> None:
        self.report = report
        super().__init__(report.summary())


class FitConfigError(DDPNotebookError, ValueError):
    """An argument of ``fit`` is not usable (nothing was started)."""


class LaunchOptionError(DDPNotebookError, ValueError):
    """A launch option (``stall_timeout``, ``timeout``, ...) is not usable (nothing was started), or
    an option of a run's control (``stop(grace=)``, ``wait(timeout=)``, ``retry(resume=)``) is not."""


class RunLoadError(DDPNotebookError, OSError):
    """``Run.load`` found no run it can read at the path or id given: no such run directory, or an
    event log that ddp_notebook did not write (or that was cut or changed since)."""


class EngineSelectionError(DDPNotebookError, TypeError):
    """``engines=`` is not an ipyparallel Client, DirectView or Engines."""


class EngineUnavailableError(DDPNotebookError, RuntimeError):
    """An engine a run (or its retry) needs has left the cluster; nothing was started."""


class NotPicklableError(DDPNotebookError, TypeError):
    """The function, an argument or a keyword argument cannot be sent to the workers."""

    def __init__(self, what: str, obj_type: str, reason: str) -> None:
        self.what = what
        self.obj_type = obj_type
        self.reason = reason
        super().__init__(
            f"{what} is a {obj_type} and cannot be sent to the worker processes: {reason}. "
            "Pass something picklable instead, or create the object inside the function."
        )


class SharedDataError(DDPNotebookError, OSError):
    """The large tensors and arrays of a call (or a result) cannot be sent or mapped: a file they
    are mapped from was cut short, replaced or rewritten, or shared memory could not be made. The
    message names the file and says what to do."""


class ArgumentsError(DDPNotebookError, TypeError):
    """The function cannot be called with the arguments given: found from its signature before
    anything starts, instead of in every worker."""


class WorkerFailedError(DDPNotebookError, RuntimeError):
    """A worker of a run failed; the message names the worker that caused it.

    ``rank``, ``device`` and ``failure`` describe the root cause; ``failures`` lists every
    failure of the run (knock-on failures of peers marked ``consequence=True``).
    """

    def __init__(self, failure: WorkerFailure, failures: Sequence[WorkerFailure],
                 run_dir: Optional[str] = None) -> None:
        self.failure = failure
        self.failures = tuple(failures)
        self.rank = failure.rank
        self.device = failure.device
        self.run_dir = run_dir
        super().__init__(failure.headline())

    def _render_traceback_(self) -> list[str]:
        # IPython calls this instead of printing the supervisor's stack: users need the
        # worker's traceback, which is where their bug is.
        return render_failure_report(self.failure, self.failures).rstrip("\n").split("\n")


class SupervisionError(DDPNotebookError, RuntimeError):
    """ddp_notebook's own supervision of a run failed (a bug in ddp_notebook, not in the user's
    code); the run's workers were ended. The message says what happened and where the log is."""


class RunStoppedError(DDPNotebookError):
    """The run was stopped before the main worker returned a result."""


class RunInterrupted(KeyboardInterrupt):
    """An interrupt (Kernel → Interrupt, Ctrl-C) while the notebook waited for a run: the run
    was stopped. Still a ``KeyboardInterrupt``, so a script ends as Ctrl-C ends it; a notebook
    shows its one line, "Run … stopped: interrupted in the notebook", and no traceback."""

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


class CellError(DDPNotebookError, RuntimeError):
    """A session's cell raised on some of its ranks; the session goes on, its namespaces kept.

    ``failures`` holds one ``WorkerFailure`` per rank that raised (traceback with the cell's
    lines, the failed frame's ``locals``), the first the cause; ``values`` the values of the ranks
    that did not raise (rank → value); ``interrupted`` the ranks still in the cell when the first
    raised, interrupted then (they did not fail)."""

    def __init__(self, message: str, failures: Sequence[WorkerFailure], values: Optional[dict] = None,
                 interrupted: Sequence[int] = ()) -> None:
        self.failures = tuple(failures)
        self.failure = self.failures[0]
        self.values = dict(values or {})
        self.interrupted = tuple(interrupted)
        super().__init__(message)

    def _render_traceback_(self) -> list[str]:
        lines = render_failure_report(self.failure, self.failures).rstrip("\n").split("\n")
        return lines[:-1] + [f"CellError: {self}"]


class SessionEndedError(DDPNotebookError, RuntimeError):
    """A session's run ended (a rank died, the watchdog named a stall, it was stopped): its ranks
    and their namespaces are gone; ``session.restart()`` forms a new one. ``failure`` and
    ``failures`` are the run's (None and empty when no rank failed)."""

    def __init__(self, message: str, failure: Optional[WorkerFailure] = None,
                 failures: Sequence[WorkerFailure] = ()) -> None:
        self.failure = failure
        self.failures = tuple(failures)
        super().__init__(message)

    def _render_traceback_(self) -> list[str]:
        if self.failure is None:
            return [f"SessionEndedError: {self}"]
        lines = render_failure_report(self.failure, self.failures).strip("\n").split("\n")
        return lines[:-1] + [f"SessionEndedError: {self}"]


class SessionBusyError(DDPNotebookError, RuntimeError):
    """A session was asked for a request while a cell it runs without blocking
    (``run(..., block=False)``, ``%%ddp --noblock``) has not ended: wait for that cell
    (``future.result()``) or stop it (the view's Stop, ``session.interrupt()``)."""


class SessionInterrupted(KeyboardInterrupt):
    """An interrupt (Kernel → Interrupt, Ctrl-C, the view's Stop) of a session's cell: the cell
    was interrupted on every rank and the session goes on. One line, no traceback."""

    def _render_traceback_(self) -> list[str]:
        return [str(self)]


class WaitTimeoutError(DDPNotebookError, TimeoutError):
    """``Run.wait(timeout=...)`` returned before the run finished; the run goes on."""


class UnsafeRunDirError(DDPNotebookError, PermissionError):
    """A runs folder (or a run directory) that another user could write to: a run's files are
    unpickled by its workers and by ``Run.load``, so they are never read from such a place."""


class NoResultError(DDPNotebookError):
    """``Run.result()`` was called before the run finished, or on a run loaded from disk whose
    result was too large to be kept there."""


class NoCheckpointError(DDPNotebookError):
    """``retry(resume=True)`` on a run that saved no checkpoint."""


class PreflightError(DDPNotebookError):
    """The single-device preflight step failed; nothing was launched.

    The original exception is the ``__cause__``, so its traceback is shown as usual."""


class NonFiniteLossError(DDPNotebookError, FloatingPointError):
    """The built-in fit's loss (or its weights, or its validation loss) became nan or inf: raised
    by the worker at the step it happened, so the report names the rank and the step (training on
    would only spread the nan), and nothing of it is saved as a checkpoint."""


class QueueUseError(DDPNotebookError, RuntimeError):
    """A worker used a queue of the call for something other than sending items to the notebook."""


class ProcessGroupMismatchError(DDPNotebookError, ValueError):
    """The function's own ``init_process_group`` asked for another world size, rank or backend
    than the run has: it could never meet (refused at once instead of waiting the rendezvous
    timeout)."""


class WorkerTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of a WorkerFailedError,
    so plain Python shows the worker's stack above the notebook's (not an error of its own)."""

    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n" + self.args[0]
