"""Deprecated: the warm pool of worker interpreters is retired.

Workers are forked by the fork server, which ``%load_ext ddp_notebook`` starts: the first launch
after it forks its workers in milliseconds, as the pool's warm workers once started. These
functions keep working for one release, with a ``DeprecationWarning``, and do what the fork
server does: ``enable()`` starts it, ``disable()`` and ``status()`` change and tell nothing of a
pool. Without a fork server (off Linux, ``DDP_NOTEBOOK_FORKSERVER=0``) workers are fresh
interpreters.
"""
from __future__ import annotations

import warnings

from .executors.local import forkserver

__all__ = ["enable", "disable", "status"]


def _deprecated(what: str) -> None:
    warnings.warn(f"ddp_notebook.pool.{what} is deprecated and will be removed: the warm pool is retired; workers "
                  "are forked by the fork server, which %load_ext ddp_notebook starts", DeprecationWarning,
                  stacklevel=3)


def enable(size: int = 2) -> None:
    """Deprecated: starts the fork server in the background (``size`` is not used).

    Parameters
    ----------
    size : int
        How many warm workers the pool kept; ignored.
    """
    _deprecated("enable()")
    forkserver.start()


def disable() -> None:
    """Deprecated: does nothing (there is no pool to turn off)."""
    _deprecated("disable()")


def status() -> dict[str, object]:
    """Deprecated: the pool's status, always off: ``{"enabled": False, "size": 0, "idle": 0}``.

    Returns
    -------
    dict
        ``enabled``, ``size`` and ``idle``, as the pool reported them.
    """
    _deprecated("status()")
    return {"enabled": False, "size": 0, "idle": 0}
