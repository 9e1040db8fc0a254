"""Sending a run's call to its ranks: the pickle, and its large tensors and arrays placed once in
shared memory where the ranks can map them (``transfer.packing``), or inlined by value for ranks
that cannot (ipyparallel engines). ``data`` events say how far the copy is, then what it took:
the panel shows "sending data 1.2/4.0 GB" meanwhile.

The copy is made within the call that starts the run (``launch``, ``retry``): the ranks get the
tensors as they were at that moment, as with pickling, even if the notebook changes them next.
Data that stays in its file (a memory-mapped file) is read from the file as the ranks use it: a
rank refuses a file rewritten since the launch, by name, and the file must not change while the
run uses it.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Optional

from ..core.events import EventKind
from ..transfer import packing
from ..transfer.packing import Packed, Placement

__all__ = ["send_data", "show_while_sending", "PROGRESS_EVERY", "SHOWN_FROM"]

PROGRESS_EVERY = 0.25
"""Seconds between two ``data`` events while a copy goes on."""
SHOWN_FROM = 256 * 2**20
"""A copy of at least this many bytes is shown while it goes on (``show_while_sending``)."""

# How a long copy shows while ``launch`` makes it, before any view of the run exists: set by the
# front end (``ui.display``): a line in the cell's output, or on stderr. Called with the bytes to
# copy, it returns what to call with (sent, total, seconds once done).
ShowSending = Callable[[int], Callable[[int, int, Optional[float]], None]]
_show_sending: Optional[ShowSending] = None


def show_while_sending(hook: Optional[ShowSending]) -> None:
    """Set how a long copy shows while it goes on (the front end calls this once)."""
    global _show_sending
    _show_sending = hook


def send_data(payload: Packed, maps_memory: bool,
              emit: Callable[[dict[str, Any]], None]) -> tuple[bytes, Optional[Placement]]:
    """The pickled call for the ranks and, when they can map memory, its pieces placed (the caller
    releases the placement once the ranks are gone)."""
    if not payload.pieces:
        return payload.data, None
    if not (maps_memory and packing.supported()):
        return payload.inline(), None
    total = payload.copied_bytes
    files = [f.path for f in payload.files if f.path is not None]
    base = {"kind": EventKind.DATA, "total": total, "files": files, "in_place": payload.in_place_bytes}
    last = [time.monotonic()]
    shown = _show_sending(total) if _show_sending is not None and total >= SHOWN_FROM else None

    def progress(sent: int, _total: int) -> None:
        now = time.monotonic()
        if now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            emit({**base, "time": time.time(), "sent": sent})
            if shown is not None:
                shown(sent, total, None)

    emit({**base, "time": time.time(), "sent": 0})
    placement = payload.place(progress)
    seconds = round(placement.seconds, 3)
    emit({**base, "time": time.time(), "sent": total, "seconds": seconds})
    if shown is not None:
        shown(total, total, seconds)
    return payload.data, placement
