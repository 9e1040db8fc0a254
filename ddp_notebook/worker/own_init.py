"""A function's own ``torch.distributed.init_process_group`` call, checked against the run.

Code written for torchrun calls ``init_process_group()`` itself (its ``RANK``, ``WORLD_SIZE`` and
``MASTER_PORT`` come from the environment, which the worker sets). Under ``launch`` the run's
group is already there, and torch would refuse a second default group: a call that asks for what
the run has joins that group instead (it returns, as torchrun's workers see it return).

A call that cannot meet — a ``world_size`` or ``rank`` other than the run's, which happens when a
``spawn`` function gets its world size from its arguments and is retried on fewer devices — is
refused at once with :class:`ProcessGroupMismatchError`, instead of waiting the whole rendezvous
timeout for ranks that will never come::

    def main(rank, world_size):               # PyTorch's DDP tutorial
        dist.init_process_group("gloo", rank=rank, world_size=world_size)

    ddp_notebook.spawn(main, args=(2,), nprocs=2)   # meets
    ddp_notebook.spawn(main, args=(2,), nprocs=1)   # ProcessGroupMismatchError: world_size=2 ...
"""
from __future__ import annotations

import inspect
from typing import Any, Optional

from ..core.errors import ProcessGroupMismatchError

__all__ = ["check_own_init", "restore_own_init"]

_original: Optional[Any] = None


def check_own_init(rank: int, world_size: int, device: str, spawn_mode: bool) -> None:
    """Check every ``init_process_group`` call of this rank (on ``device``) from now on."""
    global _original
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    if _original is not None:
        return
    _original = original = distributed_c10d.init_process_group
    signature = inspect.signature(original)
    where = f"this run has {world_size} worker{'s' if world_size != 1 else ''}"

    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            asked = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # torch's own message for a wrong call
        size, asked_rank = _number(asked.get("world_size")), _number(asked.get("rank"))
        if size is not None and size != world_size:
            raise ProcessGroupMismatchError(
                f"init_process_group(world_size={size}), but {where}: it would wait for ranks that "
                "never come. Pass the run's size (WORLD_SIZE in the environment, or nprocs for spawn), or run "
                f"on {size} devices" + (" (a function that takes its world size from args= keeps it when the "
                                        "run is retried on fewer devices)" if spawn_mode else ""))
        if asked_rank is not None and asked_rank != rank:
            raise ProcessGroupMismatchError(
                f"init_process_group(rank={asked_rank}) on the worker of rank {rank} ({device}); pass the rank the "
                "worker has (RANK in the environment, or the first argument spawn gives the function)")
        if not spawn_mode and dist.is_initialized():
            # torchrun-style code under launch: the run's group is the one it asks for.
            backend, ours = asked.get("backend"), dist.get_backend()
            named = {part.rsplit(":", 1)[-1].strip() for part in str(backend).lower().split(",")}
            if backend is not None and ours not in named:  # ("cpu:gloo,cuda:nccl" names gloo and nccl)
                advice = (f"pass backend={str(backend)!r} to launch" if str(backend).lower() in ("gloo", "nccl")
                          else f"ask for {ours!r}")
                raise ProcessGroupMismatchError(
                    f"init_process_group(backend={str(backend)!r}), but the run's process group, set up by launch, "
                    f"uses {ours!r}; {advice}, or use spawn to set up the group yourself")
            return None
        return original(*args, **kwargs)

    init_process_group.__doc__ = original.__doc__
    # Both names: code may import it from either module.
    dist.init_process_group = distributed_c10d.init_process_group = init_process_group


def restore_own_init() -> None:
    """Give torch its own ``init_process_group`` back (an engine outlives the run)."""
    global _original
    if _original is None:
        return
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    dist.init_process_group = distributed_c10d.init_process_group = _original
    _original = None


def _number(value: Any) -> Optional[int]:
    """An explicit rank or world size (torch's default -1, or None, is "from the environment")."""
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return None if number < 0 else number
