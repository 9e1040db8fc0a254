"""accelerate under ddp_notebook.

An ``Accelerator`` made inside a launched function joins the run's process group; each
``accelerator.backward`` is a step in the panel, with its loss, and what ``accelerator.log``
gets shows there too, with no change to the code. ``DDPNotebookTracker`` is that as a tracker
(``Accelerator(log_with=DDPNotebookTracker())``; accelerate calls trackers on the main process
only). ``notebook_launcher`` is a drop-in for accelerate's::

    from ddp_notebook.integrations.accelerate import notebook_launcher
    notebook_launcher(training_loop, args=(model, data), num_processes=2)
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

from accelerate.tracking import GeneralTracker

from ..core.errors import LaunchOptionError
from ..recipes.spawn import spawn
from ..worker.context import current_context
from ..worker.frameworks.reporting import guarded, scalars

__all__ = ["DDPNotebookTracker", "notebook_launcher"]


class DDPNotebookTracker(GeneralTracker):
    """An accelerate tracker that shows what ``accelerator.log(values, step)`` gets in the panel."""

    name = "ddp_notebook"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()

    @property
    def tracker(self) -> Any:
        return self

    def log(self, values: dict[str, Any], step: Optional[int] = None, **kwargs: Any) -> None:
        ctx = current_context()
        if ctx is not None:  # (a report of ours never breaks the training)
            guarded(lambda: ctx.log(step=step, **scalars(values)))


class _WithoutRank:
    """``function(*args)`` called as spawn calls its functions: ``(rank, *args)``."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function

    def __call__(self, rank: int, *args: Any) -> Any:
        return self.function(*args)


def notebook_launcher(function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: Optional[int] = None,
                      mixed_precision: str = "no", use_port: str = "29500", master_addr: str = "127.0.0.1",
                      node_rank: int = 0, num_nodes: int = 1, rdzv_backend: str = "static", rdzv_endpoint: str = "",
                      rdzv_conf: Optional[dict[str, Any]] = None, rdzv_id: str = "none", max_restarts: int = 0,
                      monitor_interval: float = 0.1, log_line_prefix_template: Optional[str] = None) -> Any:
    """accelerate's ``notebook_launcher(function, args, num_processes)`` on ddp_notebook's workers:
    ``function(*args)`` on ``num_processes`` CPU workers (default: the default devices), each
    making its own ``Accelerator()``, which joins the run's process group. What differs from
    accelerate's: the kernel never forks (CUDA may be initialized in the notebook), the ranks meet
    at a loopback store the notebook serves (``use_port`` and ``master_addr`` are not used), a
    failure names its rank, rank 0's return value is returned, and the run can be retried
    (``ddp_notebook.last_run().retry()``). ``mixed_precision`` is passed on as accelerate's
    launcher does, and ``max_restarts`` (a failed run starts again, each attempt a run of its own);
    one machine only (``num_nodes=1``); the other keywords of accelerate's launcher (rendezvous,
    monitoring) have no meaning here and are ignored."""
    if num_nodes != 1 or node_rank != 0:
        raise LaunchOptionError(f"notebook_launcher runs on this machine only: num_nodes=1 and node_rank=0, not "
                                f"num_nodes={num_nodes!r}, node_rank={node_rank!r} (for several machines, use "
                                "ddp_notebook.launch with engines=)")
    env = {"ACCELERATE_MIXED_PRECISION": str(mixed_precision)}
    return spawn(_WithoutRank(function), args=tuple(args), nprocs=num_processes, env=env, max_restarts=max_restarts)
