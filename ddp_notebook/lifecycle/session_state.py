"""What a session keeps beyond its run's state: an interrupt asked from another thread, and each
request reported as its run's events (``request``, then ``cell`` with how it ended), which
``RunState`` folds: the run's views, text and records show a session from them.
"""
from __future__ import annotations

import contextlib
import threading
import time
import weakref
from collections.abc import Iterator
from typing import Any, Optional

from ..core.bounds import cut
from ..core.errors import CellError, SessionEndedError
from ..core.events import EventKind
from ..core.failures import WorkerFailure

__all__ = ["SessionRecord", "value_text", "sessions", "session_of", "formed_after"]

#: Every session of this process not yet collected (``Session`` adds itself).
sessions: weakref.WeakSet[Any] = weakref.WeakSet()

VALUE_TEXT = 60  # characters of a rank's value kept in the last outcome's text
CODE_CHARS = 20_000  # characters of a cell's code its run's log keeps
MESSAGE_CHARS = 4000  # characters of what a cell raised, as its run's log keeps it


def value_text(text: str) -> str:
    """A rank's value as the last outcome says it: its text (computed on the rank) on one line, cut.

    >>> value_text("3"), value_text("a" * 100)[-3:], value_text("tensor([1,\\n 2])")
    ('3', 'aa…', 'tensor([1, 2])')
    """
    text = " ".join(text.split())
    return text if len(text) <= VALUE_TEXT else text[:VALUE_TEXT - 1] + "…"


def session_of(run: Any) -> Any:
    """The session whose ranks ``run`` holds now (None: ``run`` is no session's, or its session
    has been formed again since, or collected): what a view of the run asks to interrupt a cell."""
    return next((s for s in list(sessions) if s._run is run), None)


def formed_after(run: Any) -> Any:
    """The run that holds the ranks of the session ``run`` held before it was formed again (None:
    ``run`` is no session's, or still holds its session's ranks, or its session was closed since)."""
    held = getattr(run, "id", None)
    for s in list(sessions):
        if held in s._held and s._run is not run and s._run is not None and not s._closed:
            return s._run
    return None


class SessionRecord:
    """An interrupt asked from another thread (``Session.interrupt``, the view's Stop), and each
    request reported as its run's events (``tracking``); the supervisor reports each rank's answer."""

    def __init__(self, session: Any) -> None:
        self.session = session  # its run, whether it is closed
        self._interrupt = threading.Event()  # interrupt() asks the request loop to interrupt its cell

    def interrupt(self) -> bool:
        """``Session.interrupt``: whether a cell was running."""
        run = self.session.current_run
        request = run.state.request if run is not None else None
        if request is None or request.cell is None or self.session._closed:
            return False
        self._interrupt.set()
        return True

    def interrupt_asked(self) -> bool:
        """Whether ``interrupt()`` asked to interrupt the request in flight (the request loop acts on it)."""
        return self._interrupt.is_set()

    @contextlib.contextmanager
    def tracking(self, what: str, ranks: list[int], cell: Optional[int] = None,
                 code: str = "", background: bool = False) -> Iterator[list[str]]:
        """A request, as its run's events say it: begun, then how it ended (the caller adds the
        ranks' values in words to the list it is given)."""
        run = self.session.current_run  # its record goes to this run's log, whatever comes after
        started = time.time()
        first = next((line.strip() for line in code.splitlines() if line.strip()), "")
        self._interrupt.clear()
        if run is not None:
            run.stream.emit({"kind": EventKind.REQUEST, "time": started, "what": what, "cell": cell,
                             "ranks": list(ranks), "first_line": first[:120], "background": background,
                             "code": cut(code or "", CODE_CHARS)})  # kept should the notebook die in it
        values: list[str] = []
        error: Optional[BaseException] = None
        try:
            yield values
        except BaseException as e:
            error = e
            raise
        finally:
            outcome, message, failures = _outcome_of(error)
            ended_at = time.time()
            if run is not None:  # kept in the log of the run it ran in
                record = {"kind": EventKind.CELL, "time": ended_at, "cell": cell, "what": what, "ranks": list(ranks),
                          "status": outcome, "code": cut(code or "", CODE_CHARS),
                          "seconds": round(ended_at - started, 3), "message": cut(message, MESSAGE_CHARS),
                          "failures": [f.to_dict() for f in failures], "values": values}
                # A cell the session ended in ends after its run: added to the log all the same.
                run.stream.emit_late(record, lambda line: run.dir.append_private(run.dir.events_path, line))


def _outcome_of(error: Optional[BaseException]) -> tuple[str, str, tuple[WorkerFailure, ...]]:
    """How a request ended, from what it raised: (outcome, message, failures)."""
    if error is None:
        return "ok", "", ()
    if isinstance(error, CellError):
        return "failed", str(error), error.failures
    if isinstance(error, KeyboardInterrupt):  # SessionInterrupted, or a press in the notebook's part of it
        return "interrupted", str(error), ()
    if isinstance(error, SessionEndedError):
        return "ended", str(error), error.failures
    return "failed", f"{type(error).__name__}: {error}", ()
