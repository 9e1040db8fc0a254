"""ddp_notebook: PyTorch DistributedDataParallel from a notebook, with every worker in view.

>>> import ddp_notebook
>>> def train(ctx):
...     return f"rank {ctx.rank} of {ctx.world_size} on {ctx.device_name}"
>>> ddp_notebook.launch(train, devices="cpu:0,cpu:1").wait()
'rank 0 of 2 on cpu:0'
"""
from . import pool
from .context import WorkerContext, current_context
from .devices import Device, parse_devices
from .errors import (
    DDPNotebookError,
    DeviceSpecError,
    EngineSelectionError,
    EngineUnavailableError,
    InvalidDevicesError,
    NoCheckpointError,
    NoResultError,
    NotPicklableError,
    PreflightError,
    RunStoppedError,
    WaitTimeoutError,
    WorkerFailedError,
)
from .failures import WorkerFailure
from .fit import FitConfigError, FitResult, fit
from .launcher import default_devices, last_run, launch, set_default_devices
from .probes import Probe, StaticProbe
from .run import Run
from .spawn import spawn
from .state import RunState, RunStatus, WorkerState, WorkerStatus
from .validation import Finding, ValidationReport, validate_devices

__version__ = "0.1.0"

__all__ = [
    "pool", "launch", "fit", "FitResult", "spawn", "current_context", "Run", "WorkerContext", "last_run", "default_devices", "set_default_devices", "load_ipython_extension",
    "Device", "parse_devices", "validate_devices", "ValidationReport", "Finding", "Probe", "StaticProbe",
    "RunState", "RunStatus", "WorkerState", "WorkerStatus", "WorkerFailure",
    "DDPNotebookError", "DeviceSpecError", "InvalidDevicesError", "NotPicklableError",
    "WorkerFailedError", "RunStoppedError", "WaitTimeoutError", "NoResultError",
    "NoCheckpointError", "PreflightError", "FitConfigError", "EngineSelectionError",
    "EngineUnavailableError",
]


def load_ipython_extension(ipython):  # noqa: D401 - IPython's hook name
    """``%load_ext ddp_notebook``: registers the ``%ddp_*`` magics."""
    from .magics import load_ipython_extension as load

    load(ipython)
