"""Sending a run's call to its ranks: the pickle, and its large tensors and arrays placed once in
shared memory where the ranks can map them (``core.shared_data``), or inlined by value for ranks
that cannot (ipyparallel engines). ``data`` events say how far the copy is, then what it took:
the panel shows "sending data 1.2/4.0 GB" meanwhile.

The copy is made within the call that starts the run (``launch``, ``retry``): the ranks get the
tensors as they were at that moment, as with pickling, even if the notebook changes them next.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

from ..core import shared_data
from ..core.events import EventKind
from ..core.shared_data import Packed, Placement

__all__ = ["send_data", "PROGRESS_EVERY"]

PROGRESS_EVERY = 0.25
"""Seconds between two ``data`` events while a copy goes on."""


def send_data(payload: Packed, maps_memory: bool,
              emit: Callable[[dict[str, Any]], None]) -> tuple[bytes, Optional[Placement]]:
    """The pickled call for the ranks and, when they can map memory, its pieces placed (the caller
    releases the placement once the ranks are gone)."""
    if not payload.pieces:
        return payload.data, None
    if not (maps_memory and shared_data.supported()):
        return payload.inline(), None
    total = payload.copied_bytes
    files = [f.path for f in payload.files]
    last = [time.monotonic()]

    def progress(sent: int, _total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            emit({"kind": EventKind.DATA, "time": time.time(), "sent": sent, "total": total, "files": files})

    emit({"kind": EventKind.DATA, "time": time.time(), "sent": 0, "total": total, "files": files})
    placement = payload.place(progress)
    emit({"kind": EventKind.DATA, "time": time.time(), "sent": total, "total": total, "files": files,
          "seconds": round(placement.seconds, 3)})
    return payload.data, placement
