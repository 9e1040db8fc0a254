"""A failed run started again, as torch elastic's ``max_restarts`` does.

``launch``, ``fit`` and ``spawn`` with ``max_restarts=N`` start a run that failed again on the same
devices, up to N times, from its last checkpoint where it saved one (``ctx.load_checkpoint()``
returns it; ``fit`` goes on from the epoch after it). Each attempt is a run of its own: its
``parent`` is the attempt before (``%ddp_runs`` lists it under that one), its panel view shows
below the one before, and ``wait()`` on any attempt follows to the last (``Run.restarted``). A
run that was stopped (Stop, an interrupt, a pruned trial) is not started again.

    run = ddp_notebook.launch(train, devices="cpu*2", max_restarts=3)
    run.wait()        # the last attempt's result, or its failure once no restart is left

A session formed again (``restart()``, Re-form in its view, a cell cut) is a run that follows
another too: front ends hear of both in one way (``show_follow_ons_with``).
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, Optional

from ..core.errors import DDPNotebookError
from ..core.state import RunStatus

__all__ = ["restart_after", "show_follow_ons_with", "followed"]

_shown: list[Callable[[Any, Any], None]] = []  # front ends told of each run that follows another


def show_follow_ons_with(show: Callable[[Any, Any], None]) -> None:
    """Have ``show(before, new)`` called whenever a run follows another: a failed run started again
    (``max_restarts``), a session formed again. The panel shows the new run below the one before.

    Parameters
    ----------
    show : callable
        Called with the run before and the new one, from whatever thread starts the new one,
        before its ranks are ready; it must return quickly (what it raises is ignored).
    """
    _shown.append(show)


def followed(before: Any, new: Any) -> None:
    """Tell the front ends that ``new`` follows ``before`` (``show_follow_ons_with``)."""
    for show in list(_shown):
        try:
            show(before, new)
        except Exception:  # noqa: BLE001 - a front end's failure must not fail the run that follows
            pass


def restart_after(run: Any) -> Optional[Any]:
    """The new attempt of ``run``, started, when it failed with restarts left (``max_restarts``);
    None otherwise. Called once the run has ended, before its ``wait()`` returns."""
    left = run.options.max_restarts
    if left <= 0 or run.state.status != RunStatus.FAILED:  # (a session refuses max_restarts)
        return None
    root = run.state.root_failure
    try:
        new = run.retry(devices=[str(d) for d in run.devices], resume=run.dir.latest_checkpoint() is not None,
                        max_restarts=left - 1)
    except DDPNotebookError as e:
        print(f"ddp_notebook: run {run.id} failed and could not start again: {e}", file=sys.stderr)
        return None
    print(f"ddp_notebook: run {run.id} failed ({root.summary() if root is not None else 'no cause named'}); "
          f"started again as run {new.id} ({left - 1} restart{'s' if left != 2 else ''} left)", file=sys.stderr)
    followed(run, new)
    return new
