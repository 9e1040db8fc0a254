"""``spawn``: existing DDP code, unchanged, under ddp_notebook's supervision.

A drop-in for ``torch.multiprocessing.spawn(fn, args=(world_size,), nprocs=world_size)``:
``fn(rank, *args)`` is called in each worker and sets up its own process group (``MASTER_ADDR``
and ``MASTER_PORT`` are set to a free loopback port, and ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` to the worker's values). The run gets the same supervision, failure reports,
per-rank output and retry as ``launch``.

The process group's ``env://`` rendezvous meets at a TCPStore the notebook serves on a loopback
socket it holds from bind to close (every rank a client, as under torchrun's agent:
``lifecycle.store``, ``worker.spawn_store``), so nothing listens on another interface and no other local user can
take the port between its choice and its use; code that sets its own ``MASTER_PORT`` keeps
torch's rendezvous there (rank 0 serves it). What this mode cannot guarantee:
``run.retry()`` re-runs the same arguments, so a function that is given the world size as an
argument still expects its old peers: its ``init_process_group`` is refused at once
(``ProcessGroupMismatchError``, ``worker.own_init``); for a single-device re-run call
``spawn(fn, args=(1,), nprocs=1)`` instead.

Example::

    def demo_basic(rank, world_size):          # as in PyTorch's DDP tutorial
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        ...
    ddp_notebook.spawn(demo_basic, args=(2,), nprocs=2)
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Optional, Union

from ..core.devices import DeviceSpec, parse_devices
from ..core.errors import LaunchOptionError
from ..core.experiment import call_config, code_fingerprint, function_name
from ..lifecycle.call import call_parts
from ..lifecycle.launch import launch_with, wait_showing
from ..lifecycle.options import (
    CallMode,
    LaunchKwargs,
    RunSettings,
    Unpack,
    check_flag,
    options_from,
    takes_launch_options,
)
from ..lifecycle.run import Run

__all__ = ["spawn"]


# torch.multiprocessing's start methods: every one is taken, and none changes how a worker starts.
START_METHODS = ("spawn", "fork", "forkserver")
STARTED_WITHIN = 300.0  # seconds spawn(join=False) waits for the workers' processes (a first start is seconds)


@takes_launch_options
def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: Optional[int] = None, join: bool = True,
          daemon: bool = False, start_method: str = "spawn", devices: Optional[DeviceSpec] = None,
          **launch_options: Unpack[LaunchKwargs]) -> Union[Any, Run]:
    """Run ``fn(rank, *args)`` on ``nprocs`` workers, like ``torch.multiprocessing.spawn``.

    For existing DDP code (a function that calls ``init_process_group`` itself): it gets
    ddp_notebook's supervision, per-rank failure reports and retry. What the workers print is
    printed here as it comes, each line marked ``[rank1]:``, and a ``multiprocessing`` queue
    among ``args`` gets what they ``put`` in it.

    Parameters
    ----------
    fn : callable
        Called as ``fn(rank, *args)`` in every worker.
    args : tuple, default ()
        The arguments after ``rank``.
    nprocs : int, optional
        How many workers, on CPU (default 1, as torch's); or give ``devices``.
    join : bool, default True
        Wait for the run and return rank 0's return value; False returns the ``Run`` once its
        workers' processes exist (with the ``join()``, ``processes`` and ``pids()`` of torch's
        ``ProcessContext``).
    daemon : bool, default False
        Taken as torch takes it; changes nothing (workers never outlive the notebook).
    start_method : str, default "spawn"
        ``"spawn"``, ``"fork"`` or ``"forkserver"``, taken as torch takes it; changes nothing:
        every worker is forked from ddp_notebook's fork server, which never initialised CUDA (as
        safe as ``"spawn"``, as quick as ``"fork"``).
    devices : str or list, optional
        The device list instead of ``nprocs`` CPU workers (``nprocs``, if given too, must match).
    **launch_options
        The launch options below, as for :func:`ddp_notebook.launch`.

    Returns
    -------
    object or Run
        Rank 0's return value with ``join=True``, else the :class:`~ddp_notebook.Run`.

    Raises
    ------
    WorkerFailedError
        A worker failed (``join=True``); it is also torch's ``ProcessRaisedException`` or
        ``ProcessExitedException``, so ``except`` clauses written for torch keep working.
    LaunchOptionError
        ``nprocs``, ``start_method``, ``join``, ``daemon`` or a launch option cannot work, or
        ``nprocs`` does not match ``devices``.
    InvalidDevicesError
        The device list failed validation; nothing was started.
    ArgumentsError
        ``fn`` cannot be called as ``fn(rank, *args)``.
    NotPicklableError
        ``fn`` or an argument cannot be sent to the workers.

    Examples
    --------
    >>> import ddp_notebook, torch.distributed as dist
    >>> def demo(rank, world_size):
    ...     dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ...     dist.destroy_process_group()
    ...     return f"rank {rank} done"
    >>> ddp_notebook.spawn(demo, args=(2,), nprocs=2)
    'rank 0 done'
    """
    args, _ = call_parts("spawn", fn, args, None)
    check_flag("join", join)
    check_flag("daemon", daemon)
    if start_method not in START_METHODS:
        raise LaunchOptionError(f"start_method must be one of {', '.join(map(repr, START_METHODS))} (as for "
                                f"torch.multiprocessing.spawn; every one starts workers the same way here), "
                                f"not {start_method!r}")
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise LaunchOptionError(f"nprocs must be a whole number >= 1 (the number of workers) or None, not {nprocs!r}")
    if devices is None:
        devices = f"cpu*{nprocs or 1}"
    elif nprocs is not None and len(parse_devices(devices)) != nprocs:
        raise LaunchOptionError(f"nprocs={nprocs} does not match the {len(parse_devices(devices))} devices "
                                f"given ({devices!r}); give one of the two")
    options = options_from("spawn", dict(launch_options))
    config = {"function": function_name(fn), **call_config(fn, "rank", args, {})}
    settings = RunSettings(mode=CallMode.SPAWN, echo=True, origin="spawn", config=config, code=code_fingerprint([fn]))
    run = launch_with(fn, devices, args, {}, options, settings)
    return wait_showing(run) if join else _started(run)


def _started(run: Run) -> Run:
    """``run`` once every worker's process exists (its pid known) or the run has ended: torch's
    ``ProcessContext`` comes back with its processes started."""
    started = threading.Event()

    def look(_event: Any = None) -> None:
        if run.done or all(w.pid is not None for w in run.state.workers.values()):
            started.set()

    run.subscribe(look)
    look()
    started.wait(STARTED_WITHIN)
    return run
