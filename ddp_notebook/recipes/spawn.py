"""``spawn``: existing DDP code, unchanged, under ddp_notebook's supervision.

A drop-in for ``torch.multiprocessing.spawn(fn, args=(world_size,), nprocs=world_size)``:
``fn(rank, *args)`` is called in each worker and sets up its own process group (``MASTER_ADDR``
and ``MASTER_PORT`` are set to a free loopback port, and ``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK`` to the worker's values). The run gets the same supervision, failure reports,
per-rank output and retry as ``launch``.

What this mode cannot guarantee: the process group is the function's own, so with its usual
``init_method="env://"`` torch's TCPStore listens on all interfaces (``launch`` uses a
loopback-only file rendezvous instead); and ``run.retry()`` re-runs the same arguments, so a
function that is given the world size as an argument still expects its old peers: for a
single-device re-run call ``spawn(fn, args=(1,), nprocs=1)`` instead.

Example::

    def demo_basic(rank, world_size):          # as in PyTorch's DDP tutorial
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        ...
    ddp_notebook.spawn(demo_basic, args=(2,), nprocs=2)
"""
from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Optional, Union

from ..core.devices import DeviceSpec, parse_devices
from ..core.errors import LaunchOptionError
from ..engine.launch import launch_with, wait_showing
from ..engine.options import (
    CallMode,
    LaunchKwargs,
    RunSettings,
    Unpack,
    check_flag,
    options_from,
    takes_launch_options,
)
from ..engine.packing import call_parts
from ..engine.run import Run

__all__ = ["spawn"]


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@takes_launch_options
def spawn(fn: Callable[..., Any], args: tuple[Any, ...] = (), nprocs: Optional[int] = None, join: bool = True,
          devices: Optional[DeviceSpec] = None, **launch_options: Unpack[LaunchKwargs]) -> Union[Any, Run]:
    """Run ``fn(rank, *args)`` on ``nprocs`` CPU workers (or on ``devices``) like
    ``torch.multiprocessing.spawn``; with ``join`` wait and return rank 0's return value
    (raising ``WorkerFailedError`` on failure), else return the ``Run``."""
    args, _ = call_parts("spawn", fn, args, None)
    check_flag("join", join)
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise LaunchOptionError(f"nprocs must be a whole number >= 1 (the number of workers) or None, not {nprocs!r}")
    if devices is None:
        devices = f"cpu*{nprocs}" if nprocs is not None else None
    elif nprocs is not None and len(parse_devices(devices)) != nprocs:
        raise LaunchOptionError(f"nprocs={nprocs} does not match the {len(parse_devices(devices))} devices "
                                f"given ({devices!r}); give one of the two")
    options = options_from("spawn", dict(launch_options))
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_loopback_port()), **options.env}
    run = launch_with(fn, devices, args, {}, replace(options, env=env), RunSettings(mode=CallMode.SPAWN))
    return wait_showing(run) if join else run
