"""Every exception ddp_notebook raises, in one place: all derive from ``DDPNotebookError``.

>>> from ddp_notebook.errors import DDPNotebookError, InvalidDevicesError, WorkerFailedError
>>> issubclass(WorkerFailedError, DDPNotebookError) and issubclass(InvalidDevicesError, ValueError)
True

::

    DDPNotebookError
    ├── DeviceSpecError (ValueError)          a device list could not be read
    ├── InvalidDevicesError (ValueError)      a device list failed validation (``.report``)
    ├── FitConfigError (ValueError)           an argument of fit() is not usable
    ├── LaunchOptionError (ValueError)        a launch option is not usable
    ├── RunLoadError (OSError)                Run.load found no run it can read there
    ├── NotPicklableError (TypeError)         the call cannot be sent to the workers
    ├── SharedDataError (OSError)             the call's data cannot be sent or mapped
    ├── ArgumentsError (TypeError)            the function cannot take the arguments given
    ├── EngineSelectionError (TypeError)      engines= is not a Client or DirectView
    ├── EngineUnavailableError (RuntimeError) an engine left the cluster before the start
    ├── PreflightError                        fit's one-step preflight failed
    ├── NonFiniteLossError (FloatingPointError) fit's loss became nan or inf (raised in a worker)
    ├── WorkerFailedError (RuntimeError)      a worker failed; names the root cause
    ├── SupervisionError (RuntimeError)       ddp_notebook's own supervision of a run failed
    ├── RunStoppedError                       the run was stopped before a result
    ├── WaitTimeoutError (TimeoutError)       wait(timeout) returned first; the run goes on
    ├── NoResultError                         result() before the run ended
    ├── NoCheckpointError                     retry(resume=True) without a checkpoint
    ├── UnsafeRunDirError (PermissionError)   a runs folder another user could write to
    ├── QueueUseError (RuntimeError)          a worker's end of a queue was read (raised in a worker)
    ├── CellError (RuntimeError)              a session's cell raised on some ranks; the session goes on
    ├── SessionEndedError (RuntimeError)      a session's run ended: restart() forms a new one
    ├── SessionBusyError (RuntimeError)       a session's cell runs without blocking: wait for it or stop it
    └── ProcessGroupMismatchError (ValueError) a function's own init_process_group cannot meet

    KeyboardInterrupt
    ├── RunInterrupted                        an interrupt while waiting for a run stopped it
    └── SessionInterrupted                    an interrupt stopped a session's cell on every rank
"""
from __future__ import annotations

from .core.errors import (
    ArgumentsError,
    CellError,
    DDPNotebookError,
    DeviceSpecError,
    EngineSelectionError,
    EngineUnavailableError,
    FitConfigError,
    InvalidDevicesError,
    LaunchOptionError,
    NoCheckpointError,
    NonFiniteLossError,
    NoResultError,
    NotPicklableError,
    PreflightError,
    ProcessGroupMismatchError,
    QueueUseError,
    RunInterrupted,
    RunLoadError,
    RunStoppedError,
    SessionBusyError,
    SessionEndedError,
    SessionInterrupted,
    SharedDataError,
    SupervisionError,
    UnsafeRunDirError,
    WaitTimeoutError,
    WorkerFailedError,
)

__all__ = [
    "DDPNotebookError", "DeviceSpecError", "InvalidDevicesError", "FitConfigError", "LaunchOptionError",
    "RunLoadError", "NotPicklableError", "SharedDataError", "ArgumentsError", "EngineSelectionError",
    "EngineUnavailableError", "PreflightError", "NonFiniteLossError", "WorkerFailedError", "SupervisionError",
    "RunStoppedError", "WaitTimeoutError", "NoResultError", "NoCheckpointError", "UnsafeRunDirError",
    "QueueUseError", "ProcessGroupMismatchError", "RunInterrupted", "CellError", "SessionEndedError",
    "SessionBusyError", "SessionInterrupted",
]

# Tracebacks, reprs and the documentation name each class by its public home. (Pickles name it
# there too: this module imports every one of them.)
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
