"""A framework's own notebook launcher called inside a worker: the worker is already one of the
processes, so the function runs here, on this rank, instead of launching processes of its own
(accelerate's ``notebook_launcher`` would bind its fixed port on every rank and fail there).

Example (in a function given to ``ddp_notebook.launch``)::

    from accelerate import notebook_launcher
    notebook_launcher(train, args=(3,), num_processes=2)   # runs train(3) on this rank
"""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from ..context import current_context

__all__ = ["patch_notebook_launcher"]


def patch_notebook_launcher(module: ModuleType) -> None:
    """``module.notebook_launcher`` (``accelerate.launchers``) runs the function on this rank
    when called in a worker; elsewhere it is accelerate's own."""
    original = getattr(module, "notebook_launcher", None)
    if original is None or getattr(original, "__wrapped__", None) is not None:
        return

    @functools.wraps(original)
    def notebook_launcher(function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: Any = None,
                          *more: Any, **kwargs: Any) -> Any:
        ctx = current_context()
        if ctx is None:
            return original(function, args, num_processes, *more, **kwargs)
        print(f"ddp_notebook: notebook_launcher(num_processes={num_processes!r}) runs the function on this rank "
              f"(rank {ctx.rank} of the run's {ctx.world_size}): the run's workers are the processes",
              file=sys.stderr)
        return function(*args)

    module.notebook_launcher = notebook_launcher  # type: ignore[attr-defined]
