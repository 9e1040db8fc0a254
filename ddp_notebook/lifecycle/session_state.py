"""What a session is doing, as plain data: its ranks, the request they run now, the outcome of
the last one, and why it ended. ``Session.state`` gives a snapshot; front ends (the session's
view, its text) render it and nothing else.

No widgets and no IPython here: a snapshot is frozen dataclasses, read from any thread.
"""
from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from ..core.bounds import cut
from ..core.errors import ArgumentsError, CellError, SessionEndedError, SessionInterrupted
from ..core.events import EventKind
from ..core.failures import WorkerFailure
from ..core.state import CellRecord

__all__ = ["RankState", "Request", "Outcome", "SessionState", "SessionRecord", "format_session", "seconds_text",
           "value_text", "ranks_text", "RANK_STATUSES", "SESSION_STATUSES"]

#: What a rank row can say: ``forming`` (its run is starting), ``idle`` (ready for a cell),
#: ``running`` (a cell, a push or a pull), ``finished`` (its part of the request is done, other
#: ranks' is not), ``failed`` (it raised in the last request, or its death ended the session),
#: ``ended`` (the session ended: its process is gone) and ``closed``.
RANK_STATUSES = ("forming", "idle", "running", "finished", "failed", "ended", "closed")
#: What the session can say: ``forming``, ``ready``, ``running``, ``ended`` (its run ended: a rank
#: died, the watchdog named a stall; ``session.restart()`` forms it again) and ``closed``.
SESSION_STATUSES = ("forming", "ready", "running", "ended", "closed")
OUTPUT_LINES = 20  # the last lines of each rank's output a snapshot holds
VALUE_TEXT = 60  # characters of a rank's value kept in the last outcome's text
CODE_CHARS = 20_000  # characters of a cell's code its run's log keeps
MESSAGE_CHARS = 4000  # characters of what a cell raised, as its run's log keeps it


def seconds_text(seconds: float) -> str:
    """A duration as a ticking clock shows it: tenths under a minute, then minutes and hours.

    >>> seconds_text(0.04), seconds_text(12.34), seconds_text(75), seconds_text(3720)
    ('0.0 s', '12.3 s', '1 min 15 s', '1 h 2 min')
    """
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes = int(seconds // 60)
    if minutes < 60:
        return f"{minutes} min {int(seconds % 60)} s"
    return f"{minutes // 60} h {minutes % 60} min"


def value_text(text: str) -> str:
    """A rank's value as the last outcome says it: its text (computed on the rank) on one line, cut.

    >>> value_text("3"), value_text("a" * 100)[-3:], value_text("tensor([1,\\n 2])")
    ('3', 'aa…', 'tensor([1, 2])')
    """
    text = " ".join(text.split())
    return text if len(text) <= VALUE_TEXT else text[:VALUE_TEXT - 1] + "…"


def ranks_text(ranks: tuple[int, ...] | list[int]) -> str:
    """``rank 1``, ``ranks 0, 1``, ``no rank``."""
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


@dataclass(frozen=True)
class RankState:
    """One rank of a session, as a row shows it.

    ``status`` is one of ``RANK_STATUSES``; ``doing`` what it runs, or ran last (``cell 3``,
    ``push``, ``pull 'x'``); ``since`` and ``until`` when it began and finished that (wall-clock
    seconds; ``until`` None while it runs); ``note`` a line on it (the error it raised, what ended
    it); ``output`` the last lines it printed, ``(stream, text)``.
    """

    rank: int
    device: str
    status: str
    pid: Optional[int] = None
    doing: str = ""
    since: Optional[float] = None
    until: Optional[float] = None
    note: str = ""
    output: tuple[tuple[str, str], ...] = ()

    def clock(self, now: Optional[float] = None) -> str:
        """How long it has run what it runs (ticking), or took (``""`` when nothing ran yet)."""
        if self.since is None:
            return ""
        end = self.until if self.until is not None else (now if now is not None else time.time())
        return seconds_text(end - self.since)


@dataclass(frozen=True)
class Request:
    """What the ranks run now: ``what`` (``cell 3``, ``push``, ``pull 'x'``), on ``ranks``, since
    ``started_at``; ``first_line`` is the cell's first line of code; ``interrupting`` is True once
    an interrupt was sent (Stop, Kernel → Interrupt); ``background`` is True for a cell run
    without blocking (``%%ddp --noblock``: the kernel is free, and the view's Stop stops it)."""

    what: str
    ranks: tuple[int, ...]
    started_at: float
    cell: Optional[int] = None
    first_line: str = ""
    interrupting: bool = False
    background: bool = False


@dataclass(frozen=True)
class Outcome:
    """How the last request ended: ``outcome`` is ``ok``, ``failed`` (it raised on some ranks;
    the session goes on), ``interrupted`` (the session goes on) or ``ended`` (the session's run
    ended during it). ``message`` says it in one line; ``failures`` are the ranks' (the first the
    cause); ``values`` a short text of each rank's value (``[rank 0] 1``)."""

    what: str
    ranks: tuple[int, ...]
    outcome: str
    started_at: float
    ended_at: float
    cell: Optional[int] = None
    message: str = ""
    failures: tuple[WorkerFailure, ...] = ()
    values: tuple[str, ...] = ()

    @property
    def failure(self) -> Optional[WorkerFailure]:
        """The failure that caused it (None when none)."""
        return self.failures[0] if self.failures else None

    @property
    def seconds(self) -> float:
        """How long the request took."""
        return max(0.0, self.ended_at - self.started_at)

    def text(self) -> str:
        """The outcome in one line: ``cell 3 on ranks 0, 1: ok in 0.1 s ([rank 0] 1, [rank 1] 2)``,
        or the error's message and how long it took."""
        took = seconds_text(self.seconds)
        if self.outcome == "ok":
            values = f" ({', '.join(self.values)})" if self.values else ""
            return f"{self.what} on {ranks_text(self.ranks)}: ok in {took}{values}"
        if self.outcome == "ended" or not self.message:  # why it ended is said once, by the session
            return f"{self.what} on {ranks_text(self.ranks)}: {self.outcome} after {took}"
        return f"{self.message} It took {took}." if self.message.endswith(".") else f"{self.message} (after {took})"


@dataclass(frozen=True)
class SessionState:
    """A session at one moment: what its view and its text show.

    ``status`` is one of ``SESSION_STATUSES``; ``ranks`` one ``RankState`` per rank in
    rank order; ``current`` the request running now (None when none); ``last`` the outcome of the
    last one, ``last_failure`` that of the last one that failed on some ranks (it may be ``last``);
    ``ended`` why the session ended, in words, with the rank ``failure`` that ended it
    (and the run's ``failures``); ``healthy`` the devices whose rank did not cause that;
    ``cells`` how many cells the session has run (numbered 1, 2, ... across its forms).
    """

    status: str
    devices: tuple[str, ...]
    ranks: tuple[RankState, ...]
    run_id: Optional[str] = None
    formed_at: Optional[float] = None
    cells: int = 0
    current: Optional[Request] = None
    last: Optional[Outcome] = None
    last_failure: Optional[Outcome] = None
    ended: str = ""
    failure: Optional[WorkerFailure] = None
    failures: tuple[WorkerFailure, ...] = field(default=())
    healthy: tuple[str, ...] = ()

    @property
    def alive(self) -> bool:
        """Whether its ranks are there to run cells (ready or running)."""
        return self.status in ("ready", "running")

    @property
    def can_reform(self) -> bool:
        """Whether it ended on its own (not closed): ``session.restart()`` forms it again."""
        return self.status == "ended"

    def header(self) -> str:
        """The first line: ``Session of 2 ranks on cpu:0, cpu:1 (run …): ready, 3 cells run``."""
        run = f" (run {self.run_id})" if self.run_id else ""
        ranks = f"{len(self.devices)} rank{'s' if len(self.devices) != 1 else ''}"
        cells = f", {self.cells} cell{'s' if self.cells != 1 else ''} run" if self.cells else ""
        return f"Session of {ranks} on {', '.join(self.devices) or '-'}{run}: {self.status}{cells}"


def rank_line(rank: RankState, now: Optional[float] = None, frozen: bool = False) -> str:
    """A rank's row in words: ``rank 1 (cpu:1, pid 42): running cell 3 for 2.1 s`` (``frozen``:
    ``since 08:21:40``, for a text that is not redrawn as time passes)."""
    pid = f", pid {rank.pid}" if rank.pid else ""
    clock = rank.clock(now)
    if rank.status == "running" and rank.doing:
        what = f"running {rank.doing} " + (f"since {_time_of_day(rank.since)}" if frozen else f"for {clock}")
    elif rank.status == "finished" and rank.doing:
        what = f"finished {rank.doing} in {clock}, waits for the other ranks"
    elif rank.status == "failed" and rank.doing:
        what = f"failed in {rank.doing}"
    elif rank.status == "idle" and rank.doing:
        what = f"idle (last: {rank.doing}, {clock})"
    else:
        what = rank.status
    note = f": {rank.note}" if rank.note else ""
    return f"rank {rank.rank} ({rank.device}{pid}): {what}{note}"


def _time_of_day(when: Optional[float]) -> str:
    return time.strftime("%H:%M:%S", time.localtime(when)) if when is not None else "-"


def format_session(state: SessionState, now: Optional[float] = None, frozen: bool = False) -> str:
    """The session in words, as its view shows it: a header, a line per rank, what runs now, the
    last outcome and why it ended. ``frozen``: for a text that is not redrawn as time passes (a
    notebook without widgets), what runs says since when, not for how long.

    >>> s = SessionState("ready", ("cpu:0", "cpu:1"), (RankState(0, "cpu:0", "idle"), RankState(1, "cpu:1", "idle")),
    ...                  run_id="r1")
    >>> print(format_session(s))
    Session of 2 ranks on cpu:0, cpu:1 (run r1): ready
      rank 0 (cpu:0): idle
      rank 1 (cpu:1): idle
    """
    now = now if now is not None else time.time()
    lines = [state.header()]
    lines += [f"  {rank_line(r, now, frozen)}" for r in state.ranks]
    if state.current is not None:
        c = state.current
        stopping = " (interrupting)" if c.interrupting else ""
        code = f": {c.first_line}" if c.first_line else ""
        clock = f"since {_time_of_day(c.started_at)}" if frozen else f"for {seconds_text(now - c.started_at)}"
        how = " (without blocking: session.interrupt() stops it)" if c.background and not c.interrupting else ""
        lines.append(f"Running {c.what} on {ranks_text(c.ranks)} {clock}{stopping}{how}{code}")
    if state.last is not None:
        lines.append(f"Last: {state.last.text()}")
    if state.last_failure is not None and state.last_failure is not state.last:
        lines.append(f"Last failure: {state.last_failure.text()}")
    if state.ended:
        lines.append(f"Ended: {state.ended}")
    return "\n".join(lines)


class SessionRecord:
    """What a front end needs of a ``Session`` beyond its run's state: whether it is forming, who
    listens, and an interrupt asked from another thread. What its requests did is its run's
    (``RunState.request``, ``RunState.last_request``): the session reports each request as run
    events (``tracking``), the supervisor each rank's answer."""

    def __init__(self, session: Any) -> None:
        self.session = session  # its run, whether it is closed or ended, its ranks' pids
        self._listeners: list[Callable[[], None]] = []
        self._forming = False
        self._formed_at: Optional[float] = None
        self._interrupt = threading.Event()  # interrupt() asks the request loop to interrupt its cell

    # ---- what front ends read ------------------------------------------------------------------
    def state(self) -> SessionState:
        """A snapshot (``Session.state``)."""
        return self._snapshot()

    def subscribe(self, callback: Callable[[], None]) -> None:
        """``Session.subscribe``."""
        if not callable(callback):
            raise ArgumentsError(f"subscribe() takes a function callback(), not {callback!r}")
        self._listeners.append(callback)

    def interrupt(self) -> bool:
        """``Session.interrupt``: whether a cell was running."""
        run = self.session.current_run
        request = run.state.request if run is not None else None
        if request is None or request.cell is None or self.session._closed:
            return False
        self._interrupt.set()
        return True

    # ---- what the session tells ----------------------------------------------------------------
    def changed(self) -> None:
        """Tell the subscribers that the state changed."""
        for callback in list(self._listeners):
            try:
                callback()
            except Exception:  # noqa: BLE001 - a front end's failure must not break a request
                pass

    def set_forming(self, forming: bool) -> None:
        """The session's ranks are being formed (True), or are ready."""
        self._forming = forming
        if not forming:
            self._formed_at = time.time()
        self.changed()

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
                             "ranks": list(ranks), "first_line": first[:120], "background": background})
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
            self.changed()

    def _snapshot(self) -> SessionState:
        session = self.session
        run = session._run
        devices = tuple(str(d) for d in run.devices) if run is not None else ()
        state = run.state if run is not None else None
        request = state.request if state is not None else None
        last = state.last_request if state is not None and not self._forming else None
        ended = session._ended
        if session._closed:
            status = "closed"
        elif self._forming or run is None:
            status = "forming"
        elif ended is not None or run.done:
            status = "ended"
        else:
            status = "running" if request is not None else "ready"
        failures: tuple[WorkerFailure, ...] = ()
        failure = None
        why = ""
        if status == "ended":
            failures = ended.failures if ended is not None else tuple(run.failures)
            failure = ended.failure if ended is not None else run.root_failure
            why = str(ended) if ended is not None else session._end_text("the session ended")
        causing = {f.rank for f in failures if not f.consequence}
        workers = state.workers if state is not None else {}
        last_failed = {f.rank: f for f in last.failures} if last is not None and last.status != "ended" else {}
        ranks = []
        for r, device in enumerate(devices):
            w = workers.get(r)
            base: dict[str, Any] = dict(rank=r, device=device, pid=w.pid if w is not None else None,
                                        output=tuple(list(w.output)[-OUTPUT_LINES:]) if w else ())
            memo: dict[str, Any] = {}
            if last is not None and r in last.ranks:
                f = last_failed.get(r)
                note = f.summary() if f is not None else "interrupted" if last.status == "interrupted" else ""
                memo = dict(doing=last.what, since=last.time - last.seconds, until=last.time, note=note)
            if status in ("closed", "forming"):
                ranks.append(RankState(status=status, **base, **memo))
            elif status == "ended":
                mine = next((f for f in failures if f.rank == r and not f.consequence), None)
                ranks.append(RankState(status="failed" if r in causing else "ended", **base,
                                       note=mine.summary() if mine is not None else ""))
            elif request is not None and r in request.ranks:
                op, when = request.answered.get(r, ("", None))
                shown = {"done": "finished", "error": "failed", "interrupted": "failed"}.get(op, "running")
                ranks.append(RankState(status=shown, **base, doing=request.what, since=request.started, until=when))
            else:
                ranks.append(RankState(status="failed" if r in last_failed else "idle", **base, **memo))
        current = None
        if request is not None:
            current = Request(request.what, tuple(request.ranks), request.started, request.cell, request.first_line,
                              request.interrupting, request.background)
        shown_last = _outcome(last) if last is not None else None
        failed_cell = state.failed_cell if state is not None and not self._forming else None
        last_failure = shown_last if shown_last is not None and shown_last.outcome == "failed" and \
            shown_last.failures else _outcome(failed_cell) if failed_cell is not None else None
        return SessionState(status=status, devices=devices, ranks=tuple(ranks),
                            run_id=run.id if run is not None else None, formed_at=self._formed_at,
                            cells=session._cells_run, current=current, last=shown_last,
                            last_failure=last_failure, ended=why,
                            failure=failure, failures=failures,
                            healthy=tuple(d for r, d in enumerate(devices) if r not in causing))


def _outcome(record: CellRecord) -> Outcome:
    """How a request ended, as its run's record says it."""
    return Outcome(record.what, tuple(record.ranks), record.status, record.time - record.seconds, record.time,
                   record.cell, record.message, tuple(record.failures), tuple(record.values))


def _outcome_of(error: Optional[BaseException]) -> tuple[str, str, tuple[WorkerFailure, ...]]:
    """How a request ended, from what it raised: (outcome, message, failures)."""
    if error is None:
        return "ok", "", ()
    if isinstance(error, CellError):
        return "failed", str(error), error.failures
    if isinstance(error, SessionInterrupted):
        return "interrupted", str(error), ()
    if isinstance(error, SessionEndedError):
        return "ended", str(error), error.failures
    return "failed", f"{type(error).__name__}: {error}", ()
