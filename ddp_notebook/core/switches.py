"""Switches and settings read from the environment (``DDP_NOTEBOOK_PROGRESS=0``,
``DDP_NOTEBOOK_NETWORK_TIMEOUT=20``).

>>> import os
>>> os.environ["DDP_NOTEBOOK_EXAMPLE"] = "off"
>>> switched_on("DDP_NOTEBOOK_EXAMPLE"), switched_on("DDP_NOTEBOOK_UNSET")
(False, True)
>>> os.environ["DDP_NOTEBOOK_EXAMPLE"] = "20"
>>> seconds_from_env("DDP_NOTEBOOK_EXAMPLE", 10.0), seconds_from_env("DDP_NOTEBOOK_UNSET", 10.0)
(20.0, 10.0)
"""
from __future__ import annotations

import os

from .errors import LaunchOptionError

__all__ = ["switched_on", "seconds_from_env"]


def switched_on(name: str) -> bool:
    """Whether the switch ``name`` is on: it is unless set to 0, off, false or no (any case)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")


def seconds_from_env(name: str, default: float) -> float:
    """``$name`` as a number of seconds > 0 (``default`` when unset or empty); a clear
    ``LaunchOptionError`` for anything else."""
    text = os.environ.get(name)
    if text is None or not text.strip():
        return default
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise LaunchOptionError(f"${name} must be a number of seconds > 0, not {text!r}")
    return value
