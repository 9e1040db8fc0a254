"""Lightning ``Fabric`` and accelerate's ``Accelerator``: loops the user writes, so each
``backward`` is a step (with its loss) and what the code logs goes to the panel too.

An ``Accelerator`` counts a step where it syncs gradients (once per accumulation); its
``log()`` reports on every rank here, though its trackers hear only the main process.
"""
from __future__ import annotations

from types import ModuleType
from typing import Any, Optional

from ..context import current_context
from .lightning import follow_the_run
from .reporting import patch_init, scalars, wrap_method

__all__ = ["patch_fabric", "patch_accelerator", "count_step", "report_values"]

_COUNT = "_ddp_notebook_steps"


def count_step(owner: Any, loss: Any) -> None:
    """One more step of ``owner`` (a Fabric or an Accelerator), with its loss when a report is due."""
    ctx = current_context()
    if ctx is None or getattr(owner, "sync_gradients", True) is False:  # (an accumulation step)
        return
    step = getattr(owner, _COUNT, 0) + 1
    setattr(owner, _COUNT, step)
    # Every step's loss reaches the plot where reading it is free (a CPU rank); on a GPU reading it
    # waits for the step to finish: only for a report that is sent.
    metrics = scalars({"loss": loss}) if ctx.due() or ctx.device.type == "cpu" else {}
    ctx.log(step=step, **metrics)


def report_values(owner: Any, values: Optional[dict[str, Any]]) -> None:
    """What the code logged: its metrics, at our own step count."""
    ctx = current_context()
    if ctx is not None:
        ctx.log(step=getattr(owner, _COUNT, None), **scalars(values))


def patch_fabric(module: ModuleType) -> None:
    fabric = module.Fabric
    patch_init(fabric, None, before=follow_the_run)
    wrap_method(fabric, "backward", lambda self, result, tensor, *args, **kwargs: count_step(self, tensor))
    wrap_method(fabric, "log", lambda self, result, name, value, *args, **kwargs: report_values(self, {name: value}))
    wrap_method(fabric, "log_dict", lambda self, result, metrics, *args, **kwargs: report_values(self, metrics))


def patch_accelerator(module: ModuleType) -> None:
    accelerator = module.Accelerator
    wrap_method(accelerator, "backward", lambda self, result, loss, *args, **kwargs: count_step(self, loss))
    wrap_method(accelerator, "log", lambda self, result, values, *args, **kwargs: report_values(self, values))
