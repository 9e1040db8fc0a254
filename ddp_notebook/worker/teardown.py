"""Tearing a gloo process group down without torch's teardown deadlock.

Destroying a ``ProcessGroupGloo`` joins its worker threads while the destroying thread holds
the GIL. A worker thread that has just finished a collective still has to drop that work item,
whose captured thread-local state holds a Python object: it waits for the GIL, the destroyer
waits for it, and the process hangs (seen here with torch 2.13: DDP code in the style of
PyTorch's tutorial, ``destroy_process_group()`` and then returning, so that the DDP model's
reducer drops the last reference within microseconds of the last all-reduce; about one run in
seven on a warm worker or an ipyparallel engine).

So while a function runs, a group it destroys is kept alive (``hold``); it is really destroyed
only after the worker threads had time to drop their work items (``release``), or never in a
worker process that leaves with ``os._exit``.
"""
from __future__ import annotations

import time
from typing import Any, Optional

_kept: list[Any] = []
_original: Optional[Any] = None


def hold() -> None:
    """Keep every process group that ``torch.distributed.destroy_process_group`` destroys from
    now on alive (its destruction deferred to ``release``)."""
    global _original
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if _original is not None:
        return
    _original = original = distributed_c10d.destroy_process_group

    def destroy_process_group(group: Any = None) -> None:
        _kept.append(group if group is not None else dist.group.WORLD)
        original(group)

    destroy_process_group.__doc__ = original.__doc__
    # Both names: code may import it from either module.
    dist.destroy_process_group = distributed_c10d.destroy_process_group = destroy_process_group


def keep(group: Any) -> None:
    """Keep ``group`` alive until ``release`` (the default group, once it is set up)."""
    _kept.append(group)


def release(pause: float = 0.05) -> None:
    """Destroy the default group (if any) and the groups kept by ``hold``, after giving the
    gloo worker threads ``pause`` seconds, without the GIL, to finish their last work items."""
    global _original
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if _original is not None:
        dist.destroy_process_group = distributed_c10d.destroy_process_group = _original
        _original = None
    live = dist.is_available() and dist.is_initialized()
    if not (live or _kept):
        return
    time.sleep(pause)  # the worker threads take the GIL, drop their work items, and go idle
    if live:
        _kept.append(dist.group.WORLD)
        distributed_c10d.destroy_process_group()
    _kept.clear()
