"""What the user's variables held when a rank raised: a one-line summary per local variable of the
innermost frames of user code, for the failure report. Most DDP errors are a shape, dtype or
device that differs on one rank: the summaries show it without a rerun.

Bounded in number, size and time, and never failing the report: a summary that raises says so
(whatever it raises, ``SystemExit`` included); summaries past ``SUMMARY_SECONDS`` in all (a
``__repr__`` that hangs or loops) give the rest by type alone.

>>> import numpy as np
>>> summarize(np.zeros((128, 3), dtype=np.int64))
'ndarray[128, 3] int64'
>>> summarize([1, 2, 3]), summarize("x" * 200)[:12], summarize(None)
('list of 3', "'xxxxxxxxxxx", 'None')
"""
from __future__ import annotations

import reprlib
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType, TracebackType
from typing import Any, Optional

from ..core.tracebacks import is_installed_file

__all__ = ["summarize", "failed_locals", "FRAMES_KEPT", "NAMES_KEPT", "SUMMARY_CHARS"]

FRAMES_KEPT = 3  # the innermost user frame, and the frames above it toward the function
NAMES_KEPT = 30  # per frame
SUMMARY_CHARS = 100
REPR_CHARS = 80
SUMMARY_SECONDS = 2.0  # for every summary of one report together


_PLAIN = (int, float, bool, complex, str, bytes, type(None))  # summarized in no time, whatever the budget


class _TooSlow(BaseException):
    """Raised by the report's timer inside a summary that took too long (a BaseException: a
    ``__repr__`` that catches Exception does not hold it)."""

_repr = reprlib.Repr()
_repr.maxstring = REPR_CHARS
_repr.maxother = REPR_CHARS
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6


def _shape(value: Any) -> Optional[str]:
    shape = getattr(value, "shape", None)
    try:
        return ", ".join(str(int(n)) for n in shape) if shape is not None else None
    except (TypeError, ValueError):
        return None


def summarize(value: Any) -> str:
    """One line for ``value``: ``Tensor[64, 3, 28, 28] float32 cpu``, ``ndarray[128] int64``,
    ``list of 3``, else its repr cut at 80 characters."""
    if _budget.spent and type(value) not in _PLAIN:
        return f"<{type(value).__name__}: not summarized, the summaries took over {SUMMARY_SECONDS:g} s>"
    try:
        kind = type(value)
        name = kind.__name__
        shape = _shape(value)
        if shape is not None and hasattr(value, "dtype"):
            dtype = str(value.dtype).replace("torch.", "")
            device = getattr(value, "device", None)
            where = f" {device}" if device is not None and not isinstance(device, str) else ""
            grad = " requires_grad" if getattr(value, "requires_grad", False) else ""
            text = f"{name}[{shape}] {dtype}{where}{grad}"
        elif isinstance(value, (list, tuple, set, frozenset, dict)):
            text = f"{name} of {len(value)}"
        else:
            text = _repr.repr(value)
    except _TooSlow:
        _budget.spent = True
        text = f"<{type(value).__name__}: its summary took over {SUMMARY_SECONDS:g} s>"
    except BaseException as e:  # noqa: BLE001 - a broken __repr__ (even one raising SystemExit) must not fail the report
        text = f"<{type(value).__name__}: its summary raised {type(e).__name__}>"
    text = " ".join(text.split())
    return text if len(text) <= SUMMARY_CHARS else text[: SUMMARY_CHARS - 1] + "…"


def _is_data(value: Any) -> bool:
    """Not a function, class, method, module or the worker context: the code, not the data (a
    cell's namespace, where a session's rank fails, holds many)."""
    name = type(value).__name__
    if name in ("module", "WorkerContext"):  # (the ctx: the same on every rank, said by the headline)
        return False
    try:
        return not (callable(value) and not hasattr(value, "shape")
                    and name in ("function", "builtin_function_or_method", "type", "method"))
    except Exception:  # noqa: BLE001 - an object whose attribute lookup raises: summarize says so
        return True


def _frame_locals(frame: FrameType) -> dict[str, str]:
    names = [n for n, v in list(frame.f_locals.items()) if not n.startswith("__") and _is_data(v)]
    out = {name: summarize(frame.f_locals[name]) for name in names[:NAMES_KEPT]}
    if len(names) > NAMES_KEPT:
        out["…"] = f"{len(names) - NAMES_KEPT} more"
    return out


class _Budget:
    spent = False


_budget = _Budget()


@contextmanager
def _time_bound(seconds: float) -> Iterator[None]:
    """Raise ``_TooSlow`` in whatever runs here once ``seconds`` have passed (a SIGALRM timer, on
    the main thread of a process whose SIGALRM is free; elsewhere, no bound but the others)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGALRM) not in (signal.SIG_DFL, signal.SIG_IGN, None) or \
            signal.getitimer(signal.ITIMER_REAL)[0] > 0:
        yield
        return
    started = time.monotonic()

    def expire(signum: int, frame: Any) -> None:
        if not _budget.spent and time.monotonic() - started >= seconds * 0.99:
            raise _TooSlow

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        _budget.spent = False  # (summarize() outside a report has no budget)


def failed_locals(tb: Optional[TracebackType]) -> list[dict[str, Any]]:
    """The innermost frames of user code in ``tb`` (at most ``FRAMES_KEPT``, innermost first),
    each ``{"function", "file", "line", "locals": {name: summary}}``; [] when none (or on any error)."""
    try:
        with _time_bound(SUMMARY_SECONDS):
            return _user_frames(tb)
    except BaseException:  # noqa: BLE001 - the locals are a help: never fail the report for them
        return []


def _user_frames(tb: Optional[TracebackType]) -> list[dict[str, Any]]:
    try:
        user = []
        while tb is not None:
            if not is_installed_file(tb.tb_frame.f_code.co_filename):  # torch's, the stdlib's: not the user's
                user.append(tb)
            tb = tb.tb_next
        frames = []
        for t in reversed(user[-FRAMES_KEPT:]):
            code = t.tb_frame.f_code
            frames.append({"function": code.co_name, "file": code.co_filename, "line": t.tb_lineno,
                           "locals": _frame_locals(t.tb_frame)})
        return frames
    except Exception:  # noqa: BLE001 - the locals are a help: never fail the report for them
        return []
