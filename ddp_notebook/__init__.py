"""ddp_notebook: PyTorch DistributedDataParallel from a notebook, with every worker in view.

>>> import ddp_notebook
>>> def train(ctx):
...     return f"rank {ctx.rank} of {ctx.world_size} on {ctx.device_name}"
>>> ddp_notebook.launch(train, devices="cpu:0,cpu:1").wait()
'rank 0 of 2 on cpu:0'

The package is layered; imports point one way, from the top of this list down:

- ``ui``: front ends (text, HTML, widget panel, magics) that render state and call the API;
- ``recipes``: ``fit``, ``spawn`` and the demo, built on the engine;
- ``engine``: launch, ``Run``, options, packing, and the one supervision core;
- ``backends``: where ranks run (``local`` processes, ``ipyparallel`` engines) beneath it;
- ``worker``: what runs inside a rank;
- ``core``: pure Python: devices, validation, events, state, failures, run directories.

This module is the public API and the IPython extension (``%load_ext ddp_notebook``).
"""
from typing import Any

from .core.devices import Device, parse_devices
from .core.errors import (
    ArgumentsError,
    DDPNotebookError,
    DeviceSpecError,
    EngineSelectionError,
    EngineUnavailableError,
    FitConfigError,
    LaunchOptionError,
    NoCheckpointError,
    NoResultError,
    NotPicklableError,
    PreflightError,
    ProcessGroupMismatchError,
    QueueUseError,
    RunLoadError,
    RunStoppedError,
    SupervisionError,
    UnsafeRunDirError,
    WaitTimeoutError,
    WorkerFailedError,
)
from .core.failures import WorkerFailure
from .core.probes import Probe, StaticProbe
from .core.state import RunState, RunStatus, WorkerState, WorkerStatus
from .core.validation import Finding, InvalidDevicesError, ValidationReport, validate_devices
from .core.version import __version__
from .executors.local import forkserver, pool
from .lifecycle.launch import default_devices, last_run, launch, runs, set_default_devices
from .lifecycle.options import LaunchOptions
from .lifecycle.run import Run
from .recipes.fit import FitResult, fit
from .recipes.spawn import spawn
from .transfer.loading import share
from .ui import display as _display
from .ui.magics import load_ipython_extension as _load
from .ui.magics import unload_ipython_extension as _unload
from .worker.context import WorkerContext, current_context

__all__ = [
    "forkserver", "pool", "launch", "fit", "FitResult", "spawn", "current_context", "Run", "WorkerContext",
    "LaunchOptions", "share",
    "last_run", "runs", "default_devices", "set_default_devices", "load_ipython_extension", "unload_ipython_extension",
    "Device", "parse_devices", "validate_devices", "ValidationReport", "Finding", "Probe", "StaticProbe",
    "RunState", "RunStatus", "WorkerState", "WorkerStatus", "WorkerFailure",
    "DDPNotebookError", "ArgumentsError", "DeviceSpecError", "InvalidDevicesError", "NotPicklableError",
    "WorkerFailedError", "SupervisionError", "RunStoppedError", "WaitTimeoutError", "NoResultError",
    "NoCheckpointError", "PreflightError", "FitConfigError", "LaunchOptionError", "EngineSelectionError",
    "EngineUnavailableError", "UnsafeRunDirError", "RunLoadError", "QueueUseError", "ProcessGroupMismatchError",
    "__version__",
]


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext ddp_notebook``: the ``%ddp_*`` magics, the live panel as a run's display, a warm pool."""
    _load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext ddp_notebook``: undoes what loading did; runs in progress go on."""
    _unload(ipython)


# Inside IPython, a Run that is the value of a cell shows its live panel, with or without %load_ext.
_display.register()
