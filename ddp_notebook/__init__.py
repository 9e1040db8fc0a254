"""ddp_notebook: PyTorch DistributedDataParallel from a notebook, with every worker in view.

>>> import ddp_notebook
>>> def train(ctx):
...     return f"rank {ctx.rank} of {ctx.world_size} on {ctx.device_name}"
>>> ddp_notebook.launch(train, devices="cpu:0,cpu:1").wait()
'rank 0 of 2 on cpu:0'

The package is layered; imports point one way, from the top of this list down:

- ``ui``: front ends (text, HTML, widget panel, magics) that render state and call the API;
- ``integrations``: the frameworks' callbacks and drop-ins, for explicit use;
- ``recipes``: ``fit``, ``spawn`` and the demo, built on the lifecycle;
- ``lifecycle``: launch, ``Run``, options, the call, and the one supervision core;
- ``executors``: where ranks run (``local`` processes, ``ipyparallel`` engines) beneath it;
- ``worker``: what runs inside a rank;
- ``transfer``: how a call and its data travel to the ranks, and results back;
- ``core``: plain Python: devices, validation, errors, events, state, failures, run directories.

This module is the public API (``__all__``, what ``dir()`` and completion offer) and the IPython
extension (``%load_ext ddp_notebook``); every exception is in ``ddp_notebook.errors``, and here
only those a notebook commonly catches.
"""
import sys as _sys
import warnings as _warnings
from typing import Any as _Any

from . import errors
from .core.devices import Device, parse_devices
from .core.failures import WorkerFailure
from .core.state import RunStatus
from .core.validation import ValidationReport, validate_devices
from .core.version import __version__
from .errors import DDPNotebookError, FitConfigError, InvalidDevicesError, NonFiniteLossError, WorkerFailedError
from .lifecycle.launch import default_devices, last_run, launch, prune_runs, runs, set_default_devices
from .lifecycle.options import LaunchOptions
from .lifecycle.run import Run
from .lifecycle.session import Session, session
from .recipes.fit import FitResult, fit
from .recipes.spawn import spawn
from .transfer.loading import share
from .ui import display as _display
from .ui import tracebacks as _tracebacks
from .ui.comparison import Comparison, compare
from .ui.magics import load_ipython_extension as _load
from .ui.magics import unload_ipython_extension as _unload
from .ui.session_magics import SESSION_MAGICS as _SESSION_MAGICS
from .ui.session_magics import SessionMagics as _SessionMagics
from .worker.context import WorkerContext, current_context

__all__ = [
    # running
    "launch", "fit", "spawn", "share", "Run", "RunStatus", "FitResult", "LaunchOptions",
    # ranks that stay, running cells
    "session", "Session",
    # inside a worker
    "WorkerContext", "current_context",
    # devices
    "Device", "parse_devices", "validate_devices", "ValidationReport", "default_devices", "set_default_devices",
    # runs of this kernel, the runs folder, and runs side by side
    "last_run", "runs", "prune_runs", "compare", "Comparison",
    # failures (every exception: ddp_notebook.errors)
    "WorkerFailure", "DDPNotebookError", "WorkerFailedError", "InvalidDevicesError", "NonFiniteLossError",
    "FitConfigError",
    "__version__",
]

# Names of the first releases that are no longer part of the API: still found, for a release, with a
# DeprecationWarning that says where they live now.
_MOVED = {
    "pool": ("ddp_notebook.pool", None, "the warm pool is retired: workers are forked by the fork server, which "
             "%load_ext ddp_notebook starts"),
    "forkserver": ("ddp_notebook.executors.local.forkserver", None, "it is started by %load_ext ddp_notebook and "
                   "switched off with DDP_NOTEBOOK_FORKSERVER=0"),
    "Probe": ("ddp_notebook.core.probes", "Probe", None),
    "StaticProbe": ("ddp_notebook.core.probes", "StaticProbe", None),
    "RunState": ("ddp_notebook.core.state", "RunState", None),
    "WorkerState": ("ddp_notebook.core.state", "WorkerState", None),
    "WorkerStatus": ("ddp_notebook.core.state", "WorkerStatus", None),
    "Finding": ("ddp_notebook.core.validation", "Finding", None),
    # the exceptions a notebook rarely catches: in ddp_notebook.errors only
    **{name: ("ddp_notebook.errors", name, None) for name in errors.__all__ if name not in __all__},
}


def __getattr__(name: str) -> _Any:
    if name not in _MOVED:
        raise AttributeError(f"module 'ddp_notebook' has no attribute {name!r}")
    import importlib

    module, attribute, why = _MOVED[name]
    where = f"{module}.{attribute}" if attribute else module
    # ``from ddp_notebook import X`` asks twice, the import system first: the user's line warns once.
    if "importlib" not in _sys._getframe(1).f_code.co_filename:
        lead = "no longer at the package's top level" if module == "ddp_notebook.errors" else \
            "no longer part of the package's API"
        _warnings.warn(f"ddp_notebook.{name} is {lead}: " + (f"{why} ({where})" if why else f"import it from {module}"),
                       DeprecationWarning, stacklevel=2)
    found = importlib.import_module(module)
    return getattr(found, attribute) if attribute else found


def __dir__() -> list[str]:
    """The public API, the errors module and the extension's hooks: what completion offers."""
    return sorted([*__all__, "errors", "load_ipython_extension", "unload_ipython_extension"])


def load_ipython_extension(ipython: _Any) -> None:
    """``%load_ext ddp_notebook``: the ``%ddp_*`` magics, the live panel as a run's display, and
    the fork server started at once (the first launch then forks its workers in milliseconds).

    Parameters
    ----------
    ipython : IPython.core.interactiveshell.InteractiveShell
        The shell to extend (IPython passes it).
    """
    _load(ipython)
    ipython.register_magics(_SessionMagics)  # %ddp_session and %%ddp


def unload_ipython_extension(ipython: _Any) -> None:
    """``%unload_ext ddp_notebook``: undoes what loading did; runs in progress go on.

    Parameters
    ----------
    ipython : IPython.core.interactiveshell.InteractiveShell
        The shell the extension was loaded into.
    """
    _unload(ipython)
    for kind, name in _SESSION_MAGICS:
        ipython.magics_manager.magics[kind].pop(name, None)


# Inside IPython, a Run that is the value of a cell shows its live panel, with or without %load_ext.
_display.register()
# Errors of this package show the user's frames, not the library's (in IPython with its formatter).
_tracebacks.register()
