"""What a rank sends when it raised: the ``error`` event, which the run's supervisor makes a
``WorkerFailure`` of (its type, message, the user's frames of its traceback, what the user's
variables held, whether a peer's failure caused it). Every way a rank runs uses it: a launch's
process (``process``), an engine (``engine``) and a session's cells (``session_loop``).
"""
from __future__ import annotations

from typing import Any

from ..core.bounds import bound_event
from ..core.events import EventKind
from ..core.failures import Phase
from ..core.tracebacks import format_user_traceback
from .context import peak_memory
from .failed_locals import failed_locals
from .meeting import RunEndedError

__all__ = ["error_event"]


def error_event(exc: BaseException, phase: Phase) -> dict[str, Any]:
    """The ``error`` event for ``exc``: its type, message and traceback with the user's frames
    (this package's frames, the runner's first of all, mean nothing to users: ``core.tracebacks``)."""
    # Cut here, before it crosses the pipe: a message may hold a whole tensor's repr.
    return bound_event({
        "kind": EventKind.ERROR,
        "phase": phase,
        "exc_type": type(exc).__qualname__,
        "message": _text_of(exc),
        # Sending the result back runs only the pickler's frames: nothing of the user's to show.
        "traceback": "" if phase == Phase.RESULT else format_user_traceback(exc),
        # What the user's variables held (a knock-on's are of no interest: its peer failed first).
        "locals": [] if isinstance(exc, RunEndedError) or phase == Phase.RESULT else failed_locals(exc.__traceback__),
        "knock_on": isinstance(exc, RunEndedError),  # raised because a peer's failure ended the run
        "memory": peak_memory(),  # (a rank that ran out of memory: how much it held)
    })


def _text_of(exc: BaseException) -> str:
    """``str(exc)``, or what Python prints when that raises too."""
    try:
        return str(exc)
    except Exception:  # noqa: BLE001 - an exception's own __str__ may be broken
        return "<exception str() failed>"
