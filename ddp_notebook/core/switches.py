"""On/off switches read from the environment (``DDP_NOTEBOOK_PROGRESS=0``).

>>> import os
>>> os.environ["DDP_NOTEBOOK_EXAMPLE"] = "off"
>>> switched_on("DDP_NOTEBOOK_EXAMPLE"), switched_on("DDP_NOTEBOOK_UNSET")
(False, True)
"""
from __future__ import annotations

import os

__all__ = ["switched_on"]


def switched_on(name: str) -> bool:
    """Whether the switch ``name`` is on: it is unless set to 0, off, false or no (any case)."""
    return os.environ.get(name, "1").strip().lower() not in ("0", "off", "false", "no")
