"""Sessions: ranks that stay, and run the cells the notebook sends them.

A session is one started run (``start_run``) whose ranks run in its ``session`` mode: each runs
the session's loop (``worker.session_loop``), which keeps its rank and the process group alive
and serves the notebook's requests, which travel on the run's own transport (the ranks' control
pipes there, their event pipes back). So everything a launch has, a session has: the fork server,
the process group, the event log, the supervisor that names a rank that died (and ends the
others), the stall watchdog, the lifeline that ends every rank when the kernel dies,
``last_run()`` and the magics.

What the session adds, on the notebook's side: one request at a time to some or all ranks (a
cell, values to push, a name to pull); their output shown live, line by line, each line named by
its rank; the replies gathered by rank. A cell that raised on some ranks raises ``CellError``
(traceback with the cell's lines, the failed frame's locals) and the session goes on; a run that
ended raises ``SessionEndedError`` with its failure, and ``restart()`` forms a new one on the same
devices; an interrupt while a cell runs interrupts it on every rank (``SessionInterrupted``).
The examples are :func:`session`'s.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Optional, Union

from ..core.devices import DeviceSpec
from ..core.errors import (
    ArgumentsError,
    CellError,
    DDPNotebookError,
    LaunchOptionError,
    SessionBusyError,
    SessionEndedError,
    SessionInterrupted,
)
from ..core.events import cell_file_name
from ..core.failures import FailureKind, WorkerFailure, ranks_text
from ..core.probes import Probe
from ..core.state import RunState
from ..core.validation import InvalidDevicesError
from .call import Call
from .cell_names import RANK_NAMES, cell_binds, new_sources, packed, pickled_names
from .cell_phase import INTERRUPT_GRACE, CellPhase
from .launch import start_run, validate_for
from .options import CallMode, LaunchKwargs, LaunchOptions, RunSettings, Unpack, options_from, takes_launch_options
from .restarts import followed
from .run import Run
from .session_exchange import (
    Answers,
    BetweenCells,
    CellOutput,
    Exchange,
    Gathered,
    RankGone,
    ValueNotSent,
    answered,
    hellos,
    interrupts_counted,
    interrupts_said,
    loaded_value,
    on_run_event,
    unsent_error,
)
from .session_failures import cell_error, ended_text, failures_of, push_hint
from .session_state import SessionRecord, sessions, value_text

__all__ = ["Session", "CellFuture", "ValueNotSent", "session", "current_session", "set_current_session",
           "RANK_NAMES", "INTERRUPT_GRACE"]

# Seconds a session waits for its run to end once a rank is gone (the supervisor names the cause
# and ends the others within kill_grace).
END_WAIT = 30.0
HURRIED = 1.0  # seconds the ranks get to leave once Kernel → Interrupt is pressed while a session closes

_current: Optional[Session] = None


def current_session() -> Optional[Session]:
    """The kernel's current session (``%ddp_session`` sets it), or None."""
    return _current


def set_current_session(value: Optional[Session]) -> None:
    """Make ``value`` the kernel's current session (what ``%%ddp`` runs cells on)."""
    global _current
    _current = value


class CellFuture(Future):
    """A cell run without blocking (``Session.run(code, block=False)``, ``%%ddp --noblock``), a
    :class:`concurrent.futures.Future`: ``result(timeout)`` waits for the ranks' values (a list by
    rank) or raises what the cell raised (``CellError``, ``SessionInterrupted``...); ``done()``
    says whether it ended. ``cell`` is the session's number for the cell."""

    def __init__(self, cell: int) -> None:
        super().__init__()
        self.cell = cell


class Session:
    """Ranks that stay: each with a namespace of its own, kept across cells, holding ``rank``,
    ``world_size``, ``ctx`` (its ``WorkerContext``), ``torch`` and ``dist`` (the process group is
    set up), and whatever cells define there. Made by :func:`ddp_notebook.session`.

    Examples
    --------
    ::

        s = ddp_notebook.session("cpu*2")
        s.run("x = rank * 10")
        s.run("x + 1")          # [1, 11]
        s.close()
    """

    def __init__(self, devices: Optional[DeviceSpec], options: LaunchOptions, probe: Optional[Probe] = None) -> None:
        if options.max_restarts:
            raise LaunchOptionError("a session does not take max_restarts: session.restart() forms it again")
        self._spec = devices
        self.options = options
        self._probe = probe
        self._run: Optional[Run] = None
        self._answers: Answers = Answers()
        self._ids = itertools.count(1)
        self._cells_run = 0  # the session's cells, numbered from 1 (its own count, not In[N])
        self._sources_sent: set[str] = set()
        self._closed = False
        self._ended: Optional[SessionEndedError] = None
        self._asked: list[int] = []  # the ranks of the request in flight
        self._busy = threading.Lock()  # held while a request is in flight (one at a time)
        self._background: Optional[threading.Thread] = None  # the thread of a cell run without blocking
        self._closing: Optional[str] = None  # close() stops a cell run without blocking: "closed", "formed again"
        self._record = SessionRecord(self)  # an interrupt asked from another thread; each request's events
        self._between = BetweenCells()  # what the ranks print while no request is in flight
        self._exchanging = threading.Event()  # set while a request is in flight: its cell shows what they print
        self._stage = threading.local()  # where the request of this thread is: session_exchange.interrupts_said
        self._formed: list[Run] = []  # the run of its ranks, for the finalizer: they leave with the session
        self._held: list[str] = []  # the ids of every run that held its ranks
        weakref.finalize(self, _close_ranks, self._formed)
        sessions.add(self)
        self._start()

    # ---- forming -------------------------------------------------------------------------------
    def _start(self, parent: Optional[Run] = None) -> None:
        """Form the ranks (a new run; ``parent``: the run this one follows, formed again: the
        front ends hear of it, ``restarts.followed``)."""
        self._closing = None
        strict = self.options.stall_timeout
        is_strict = isinstance(strict, (int, float)) and not isinstance(strict, bool)
        heartbeat = min(float(strict) / 3, 10.0) if is_strict else None  # type: ignore[arg-type]
        self._answers = answers = Answers()
        try:
            # Its record names it a session, with no config; its ranks' answers come to ``answers``.
            # The ranks run the session's loop (its call has no function): CallMode.SESSION.
            settings = RunSettings(mode=CallMode.SESSION, origin="session",
                                   answers=functools.partial(answered, answers, self._between, self._exchanging))
            self._run = run = start_run(Call(None, (heartbeat,)), self._spec, self.options, settings, parent=parent,
                                        probe=self._probe)
            run._restart = functools.partial(_form_again_for, weakref.ref(self))  # its retry forms the session again
            self._formed[:] = [run]
            self._between.ranks = len(run.devices)
            self._held.append(run.id)
            run.subscribe(lambda event: on_run_event(answers, event))  # (never the session: its finalizer ends ranks)
            self._ended, self._closed = None, False
            if parent is not None:  # its views show the new run
                followed(parent, run)
            # Every rank says hello once the run has started (the fork server, the process group).
            if not hellos(answers, len(run.devices), lambda: run.done):
                raise self._end_error("the session could not start")
        except BaseException as e:
            with interrupts_counted():  # (a second press: they are being ended)
                if self._run is not None and not self._run.done:
                    self._run.stop(grace=0.0)
                    self._wait_end(END_WAIT)
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, SessionInterrupted):  # one line, not our frames
                self._closed = True  # (as it says: no session was formed)
                raise SessionInterrupted("Forming the session was interrupted: its ranks were ended, "
                                         "no session was formed") from None
            raise

    # ---- what it is ------------------------------------------------------------------------------
    @property
    def current_run(self) -> Optional[Run]:
        """The run that holds the ranks (a new one after ``restart()``): its panel, events and
        failures are the session's."""
        return self._run

    @property
    def world_size(self) -> int:
        """How many ranks the session has."""
        return len(self._run.devices) if self._run is not None else 0

    @property
    def devices(self) -> list[str]:
        """The ranks' devices, in rank order (``["cpu:0", "cpu:1"]``)."""
        return [str(d) for d in self._run.devices] if self._run is not None else []

    @property
    def alive(self) -> bool:
        """True while the ranks are there to run cells (not closed, its run not ended)."""
        return not self._closed and self._run is not None and not self._run.done and self._ended is None

    def __repr__(self) -> str:
        state = self.state
        return (f"<Session {state.run_id or '-'} {state.session_status} on {', '.join(self.devices) or '-'}"
                f"{f', {state.cells} cells run' if state.cells else ''}>")

    # ---- what front ends read ---------------------------------------------------------------------
    @property
    def state(self) -> RunState:
        """What the session is doing now: its run's state (``current_run.state``), which holds
        its ranks, the request in flight (``request``), how the last one ended
        (``last_request``), its cells (``cell_records``) and, once it has ended, why
        (``root_failure``); ``session_status`` says it in a word. ``current_run.subscribe``
        says when it changes.

        Returns
        -------
        RunState
            The state of the run that holds the ranks (an empty one while none does).
        """
        return self._run.state if self._run is not None else RunState()

    def interrupt(self) -> bool:
        """Interrupt the cell running now on every rank, as Kernel → Interrupt does: the cell
        raises ``SessionInterrupted`` and the session goes on. Safe to call from any thread: the
        view's Stop calls it for a cell run without blocking (``run(..., block=False)``).

        Returns
        -------
        bool
            Whether a cell was running (and is being interrupted).
        """
        return self._record.interrupt()

    # ---- requests --------------------------------------------------------------------------------
    def _ranks(self, ranks: Union[None, int, Iterable[int]]) -> list[int]:
        world = self.world_size
        valid = f"0 to {world - 1}" if world > 1 else "0"
        if ranks is None:
            return list(range(world))
        chosen = [ranks] if isinstance(ranks, int) and not isinstance(ranks, bool) else ranks
        try:
            if isinstance(chosen, (str, bytes)):  # ("0", "0-1": %%ddp --ranks takes text, run() numbers)
                raise TypeError
            out = list(chosen)  # type: ignore[arg-type]
        except TypeError:
            raise ArgumentsError(f"ranks is a rank or a list of ranks ({valid}), or None for every rank, "
                                 f"not {ranks!r}") from None
        bad = [r for r in out if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < world]
        if bad or not out or len(set(out)) != len(out):
            what = f"{bad[0]!r} is not a rank of this session" if bad else \
                "no rank was chosen" if not out else "a rank is chosen twice"
            raise ArgumentsError(f"ranks {ranks!r}: {what} (its ranks are {valid})")
        return sorted(out)

    def _check_alive(self) -> None:
        if self._closed:
            raise SessionEndedError("the session is closed; ddp_notebook.session(...) forms a new one "
                                    "(or session.restart())")
        if self._ended is not None:
            raise self._ended
        if self._run is None or self._run.done:
            raise self._end_error("the session ended")

    def _request(self, ranks: list[int], message: dict[str, Any], cell: Optional[int] = None,
                 output: Optional[CellOutput] = None) -> Gathered:
        """Send ``message`` to ``ranks`` and gather their replies, showing output as it comes
        (``session_exchange``); a request cut (ranks left in it) forms the session again."""
        self._check_alive()
        self._between.follow(contextvars.copy_context())  # (a thread of a cell prints there once it ended)
        self._asked = list(ranks)
        exchange = Exchange(self._tell, self._answers, self._begin, ranks, dict(message, id=next(self._ids)), cell,
                            self._record, output)
        self._exchanging.set()
        self._stage.now = None  # presses are the exchange's, and what follows (a cut, an end) says its own
        try:
            outcome = exchange.run()
        except RankGone:
            self._gone(cell, exchange.outcome.replies)
        finally:
            self._exchanging.clear()
        if outcome.cut:
            self._cut(cell, message, outcome)
        # Interrupted, unless a rank raised meanwhile: then the request failed, and its error is said.
        if outcome.interrupted and not outcome.raised:
            if cell is None:
                raise SessionInterrupted(f"{message.get('op', 'the request').capitalize()} interrupted, but it could "
                                         "not be stopped midway: it finished on every rank; the session goes on")
            stopped = [r for r, m in outcome.replies.items() if m.get("interrupted")]
            how = f"interrupted on {ranks_text(stopped)}" if stopped else \
                "interrupted as every rank finished it (its values are dropped)"
            after = f"the session is being {self._closing}" if self._closing else \
                "the session goes on (its namespaces are kept)"
            raise SessionInterrupted(f"Cell {cell} {how}; {after}")
        if len(ranks) == self.world_size and all(m["op"] == "done" for m in outcome.replies.values()):
            self._tell(ranks, {"op": "idle"})  # a strict watchdog's ranks report progress until the next cell
        return outcome

    def _begin(self, request_id: int, cell: Optional[int], ranks: list[int]) -> Optional[CellPhase]:
        return self._run._begin_cell(request_id, cell, ranks) if self._run is not None and not self._run.done else None

    def _tell(self, ranks: list[int], message: dict[str, Any], body: Optional[bytes] = None,
              give_up: Optional[Callable[[], bool]] = None) -> list[int]:
        """Send to ``ranks`` on the run's transport; the ranks it did not reach."""
        return self._run._tell(ranks, message, body, give_up) if self._run is not None else list(ranks)

    def _cut(self, cell: Optional[int], message: dict[str, Any], outcome: Gathered) -> None:
        """Some ranks are still in the request and cannot leave it (a collective that will not
        complete, native code, a frame half sent): the session is formed again, and the cell's
        failure (or the interrupt) raised with a word on it."""
        assert self._run is not None
        where = f"cell {cell}" if cell is not None else message.get("op", "the request")
        failures, values, interrupted = self._failures(cell, outcome)
        left = sorted(set(outcome.left_waiting) | set(outcome.stuck))
        if outcome.abandoned:
            why = f"{where} was interrupted three times while it was being sent, so its ranks could not go on"
        elif outcome.left_waiting:
            why = "; ".join(f"rank {r} was left waiting in {w}" for r, w in sorted(outcome.left_waiting.items()))
            why += " (for peers that will not come)"
        else:
            why = f"{ranks_text(left)} did not leave {where} " + ("before it was interrupted again" if outcome.given_up
                                                                  else "when interrupted (native code cannot be)")
        if self._closing:  # the session is being closed: its run ends, nothing is formed again
            self._run._request_stop(0.0, f"{where} was cut as the session was {self._closing}: {why}")
            self._wait_end(END_WAIT)
            raise SessionInterrupted(f"{where.capitalize()} interrupted as the session was {self._closing}; {why}")
        note = self._form_again(f"{where} was cut: {why}")
        # A rank raised, or one skipped a collective: a failed cell (each failure says where its
        # rank was left; the note, what became of the session). Otherwise the user interrupted it.
        if outcome.raised or (outcome.left_waiting and not outcome.interrupted):
            raise self._error(cell, failures, values, interrupted=interrupted, note=note, formed_again=True)
        raise SessionInterrupted(f"{where.capitalize()} interrupted; {why}. {note}")

    def _form_again(self, reason: str) -> str:
        """End the session's run now (its ranks are left in a request) and form it anew; the
        words that say so."""
        assert self._run is not None
        old = self._run
        old._request_stop(0.0, reason)
        self._wait_end(END_WAIT)
        try:
            self._run = None
            self._start(parent=old)
        except BaseException as e:  # (an interrupt raised as it is; an error said with the way out)
            if self._run is None:
                self._run = old
            if not isinstance(e, Exception):
                raise
            self._ended = SessionEndedError(f"{reason}; forming the session again failed: {e}. session.restart() tries "
                                            "again")
            return f"Forming the session again failed: {e}. session.restart() tries again."
        new = self._run.id if self._run is not None else "-"
        return (f"The session was formed again on {', '.join(self.devices)} as run {new} (after run {old.id}): the "
                "ranks' namespaces were lost.")

    def _gone(self, cell: Optional[int], replies: dict[int, dict]) -> None:
        """A rank's socket closed, or the run ended: wait for the run's verdict and raise it."""
        assert self._run is not None
        self._wait_end(END_WAIT)
        if self._closing:
            what = f"Cell {cell}" if cell else "The request"
            raise SessionInterrupted(f"{what} ended as the session was {self._closing}")
        finished = sorted(r for r, m in replies.items() if m["op"] == "done")
        unfinished = [r for r in self._asked if r not in replies]
        extra = ""
        root = self._run.root_failure
        # A rank that stalled where others had finished: a collective only some reached (never
        # said of a rank that died, raised or was killed by itself).
        if cell is not None and finished and unfinished and root is not None and root.kind == FailureKind.STALL:
            extra = (f" ({ranks_text(finished)} had finished cell {cell}, {ranks_text(unfinished)} had not: a "
                     "collective that some ranks skip or reach in another order leaves the others waiting)")
        raise self._end_error("the session ended", extra)

    def _wait_end(self, seconds: float) -> bool:
        assert self._run is not None
        try:
            self._run.wait(seconds)
        except DDPNotebookError:
            pass
        return self._run.done

    def _end_error(self, what: str, extra: str = "") -> SessionEndedError:
        assert self._run is not None
        text = ended_text(self._run, what, extra, self.devices, self.options.engines is not None)
        error = SessionEndedError(text, self._run.root_failure, self._run.failures)
        self._ended = error
        return error

    # ---- the API ---------------------------------------------------------------------------------
    def run_cell(self, code: str, ranks: Union[None, int, Iterable[int]] = None,
                 namespace: Optional[dict[str, Any]] = None, block: bool = True,
                 show: bool = False, announce: Optional[Callable[[int], None]] = None) -> Union[list[Any], CellFuture]:
        """:meth:`run`, with the notebook's namespace given (the magics pass the shell's).

        ``show``: display each rank's value under its output (``[rank 1] Out: ...``), formatted
        on the rank (a figure as an image), as ``%%ddp`` does; the values themselves then come
        to the notebook only for a cell run without blocking (its future's result), so a large
        value is never sent only to be printed. ``announce(cell)``: called for a cell run without
        blocking before anything of it can print (the magic says the cell runs on its own line)."""
        if not isinstance(code, str):
            raise ArgumentsError(f"run() takes the cell's code as a string, not {type(code).__name__}")
        if not isinstance(block, bool):
            raise ArgumentsError(f"block is True or False, not {block!r}")
        chosen = self._ranks(ranks)
        self._check_alive()
        self._check_free()
        cell = self._cells_run + 1  # numbered once it is sent: a syntax error uses no number
        with interrupts_said(self._stage, "the cell", f"cell {cell}", chosen):
            compile(code, cell_file_name(cell), "exec")  # a syntax error is the same on every rank: said here
            if namespace is None:
                main = sys.modules.get("__main__")
                namespace = vars(main) if main is not None else {}
            message = {"op": "run", "cell": cell, "code": code, "names": pickled_names(code, namespace),
                       "sources": new_sources(self._sources_sent), "show": bool(show), "value": not show or not block}
            self._cells_run = cell
            if block:
                with self._claimed():
                    return self._cell(cell, chosen, code, message, namespace, background=False)
        future = CellFuture(cell)
        future.set_running_or_notify_cancel()  # running: cancel() cannot take it back (interrupt() stops it)
        with self._claimed(keep=True):
            def work() -> None:
                values: list[Any] = []
                error: Optional[BaseException] = None
                try:
                    values = self._cell(cell, chosen, code, message, namespace, background=True)
                except BaseException as e:  # noqa: BLE001 - the cell's outcome: future.result() raises it
                    error = e
                finally:
                    self._busy.release()  # free before anyone waiting on the future hears of its end
                if error is not None:
                    future.set_exception(error)
                else:
                    future.set_result(values)

            # In a copy of this context: in a notebook, what the request prints goes to this cell.
            context = contextvars.copy_context()
            self._background = threading.Thread(target=context.run, args=(work,), name=f"ddp-session-cell-{cell}",
                                                daemon=True)
            if announce is not None:
                announce(cell)
            self._background.start()
        return future

    def _cell(self, cell: int, chosen: list[int], code: str, message: dict[str, Any], namespace: dict[str, Any],
              background: bool) -> list[Any]:
        with self._record.tracking(f"cell {cell}", chosen, cell, code, background=background) as said:
            output = CellOutput(ranks=len(chosen))
            outcome = self._request(chosen, message, cell, output)
            self._stage.now = "after"
            replies = outcome.replies
            if any(m["op"] == "error" for m in replies.values()):
                failures, done, interrupted = self._failures(cell, outcome)
                hint = push_hint(replies, namespace, cell_binds(code))
                raise self._error(cell, failures, done, interrupted=interrupted, note=hint)
            values = [loaded_value(r, replies[r]) for r in chosen]
            for r in chosen:
                shown = replies[r].get("shown")
                if isinstance(shown, dict) and shown:
                    output.display(r, shown, {}, label="Out: ")
                text = shown.get("text/plain") if isinstance(shown, dict) else replies[r].get("text")
                if isinstance(text, str):
                    said.append(f"[rank {r}] {value_text(text)}")
            output.close()
        return values

    def _check_free(self) -> None:
        if self._busy.locked():
            raise self._busy_error()

    def _busy_error(self) -> SessionBusyError:
        doing = self.state.request
        what = doing.what if doing is not None else "a cell"
        return SessionBusyError(f"the session is still running {what} (run without blocking): wait for it "
                                "(future.result()), or stop it (Stop in the session's view, or session.interrupt())")

    @contextlib.contextmanager
    def _claimed(self, keep: bool = False) -> Iterator[None]:
        """One request at a time: held while it runs (``keep``: the request's thread releases it)."""
        if not self._busy.acquire(blocking=False):
            raise self._busy_error()
        handed_over = False
        try:
            yield
            handed_over = keep
        finally:
            if not handed_over:
                self._busy.release()

    def run(self, code: str, ranks: Union[None, int, Iterable[int]] = None,
            block: bool = True) -> Union[list[Any], CellFuture]:
        """Run ``code`` on the chosen ranks, each in its own namespace (kept across cells).

        The functions, classes and modules of the notebook (``__main__``) that the code names are
        put in the ranks' namespaces first (functions and classes defined in the notebook travel
        by value, as a launch sends its function; modules by name). What the ranks print shows
        live, each line starting with ``[rank N]``.

        Parameters
        ----------
        code : str
            The cell: statements, ending with an expression whose value is returned (or not).
        ranks : int or list of int, optional
            The ranks to run it on (default: every rank).
        block : bool, default True
            False: return at once a :class:`CellFuture` while the ranks run the cell (the
            notebook stays free; what the ranks print goes to the cell that ran it; Stop in the
            session's view, or ``session.interrupt()``, interrupts it). One request at a time:
            until it ends, another raises ``SessionBusyError``.

        Returns
        -------
        list or CellFuture
            The value of the cell's last expression on each chosen rank, in rank order (None
            where the cell ends with a statement); with ``block=False``, the future of that list.

        Raises
        ------
        CellError
            The cell raised on some ranks: the first is named, with its traceback and locals;
            the session goes on.
        SessionEndedError
            The session's run ended (a rank died, the watchdog named a stall): ``restart()``.
        SessionInterrupted
            Kernel → Interrupt interrupted the cell on every rank; the session goes on.
        NotPicklableError
            A function or class of the notebook that the cell uses cannot be sent.
        SyntaxError
            The code is not Python (nothing was sent).
        SessionBusyError
            A cell run with ``block=False`` has not ended.
        """
        return self.run_cell(code, ranks, block=block)

    def push(self, **values: Any) -> None:
        """Put values into every rank's namespace: ``session.push(lr=0.1, data=tensor)``.

        Parameters
        ----------
        **values
            Names and the values they take on every rank. Tensors and arrays of 64 kB or more
            are placed once in shared memory and mapped by each rank (copy-on-write: what a
            rank writes stays its own), as a launch sends its data; the rest is pickled (all
            of it for ranks on engines).

        Raises
        ------
        NotPicklableError
            A value cannot be sent (named).
        SessionEndedError
            The session's run ended.
        """
        if not values:
            raise ArgumentsError("push() takes the values to send as keywords: session.push(lr=0.1)")
        odd = sorted(k for k in values if not k.isidentifier() or (k.startswith("__") and k.endswith("__")))
        if odd:
            raise ArgumentsError(f"push() takes names a cell can use, not {odd[0]!r} (an identifier such as "
                                 "'lr', not a dunder name like '__builtins__')")
        bad = sorted(set(values) & RANK_NAMES)
        if bad:
            raise ArgumentsError(f"push() cannot replace {bad[0]!r}: each rank has its own "
                                 f"({', '.join(sorted(RANK_NAMES))})")
        self._check_alive()
        what, ranks = f"push {', '.join(values)}", list(range(self.world_size))
        with self._claimed(), interrupts_said(self._stage, what, what, ranks), self._record.tracking(what, ranks):
            data, placed = packed(values, by_value=self.options.engines is not None)
            try:
                message = {"op": "push", "values": data, "table": placed.table if placed is not None else None}
                replies = self._request(ranks, message).replies
            finally:
                if placed is not None:  # the ranks that mapped the pieces keep them
                    placed.release()
            if any(m["op"] == "error" for m in replies.values()):
                raise self._error(None, *self._failures(None, Gathered(replies)), what="push")

    def pull(self, name: str) -> list[Any]:
        """The value ``name`` holds on every rank, as a list by rank.

        Parameters
        ----------
        name : str
            A name of the ranks' namespaces.

        Returns
        -------
        list
            Its value on each rank, in rank order.

        Raises
        ------
        CellError
            ``name`` is not defined on some rank, or its value cannot be sent back.
        """
        if not isinstance(name, str) or not name.isidentifier():
            raise ArgumentsError(f"pull() takes a name of the ranks' namespaces, such as 'loss', not {name!r}")
        self._check_alive()
        what, ranks = f"pull {name!r}", list(range(self.world_size))
        with self._claimed(), interrupts_said(self._stage, what, what, ranks), self._record.tracking(what, ranks):
            replies = self._request(ranks, {"op": "pull", "name": name}).replies
            self._stage.now = "after"
            values = {r: loaded_value(r, m) for r, m in replies.items() if m["op"] == "done"}
            replies.update({r: unsent_error(name, v) for r, v in values.items() if isinstance(v, ValueNotSent)})
            if any(m["op"] == "error" for m in replies.values()):
                raise self._error(None, *self._failures(None, Gathered(replies)), what=f"pull {name!r}")
        return [values[r] for r in range(self.world_size)]

    def close(self) -> None:
        """End the session: every rank leaves its loop and the run ends (succeeded; Kernel →
        Interrupt meanwhile ends the ranks at once); safe to call twice, and once its run ended."""
        self._close("closed")

    def _close(self, how: str) -> bool:
        """``close()``; ``how``: what becomes of the session (a cell cut meanwhile says it). Whether
        Kernel → Interrupt was pressed meanwhile."""
        run = self._run
        if self._closed or run is None:
            return False
        # Kernel → Interrupt while it closes never leaves it half closed: the ranks get a second more to leave.
        with interrupts_counted() as presses:
            def waited(wait: Callable[[float], bool], seconds: float) -> bool:
                """``wait(timeout)`` until it says done, for ``seconds`` at most (``HURRIED`` once pressed)."""
                until = time.monotonic() + seconds
                while not wait(min(max(until - time.monotonic(), 0.0), 0.05)):  # (a look at the presses each 0.05 s)
                    if time.monotonic() >= until:
                        return False
                    until = min(until, time.monotonic() + HURRIED) if presses.count else until
                return True

            def joined(timeout: float) -> bool:
                assert background is not None
                background.join(timeout)
                return not background.is_alive()

            background = self._background
            if background is not None and background.is_alive() and background is not threading.current_thread():
                self._closing = how  # a cell cut now ends with these ranks: it is not formed again by itself
                self.interrupt()  # a cell run without blocking: stopped first, as Stop would
                waited(joined, INTERRUPT_GRACE + END_WAIT)
            self._closed = True
            self._tell(list(range(self.world_size)), {"op": "close"})
            if not waited(self._wait_end, run.options.stop_grace + run.options.kill_grace + 10.0):
                run.stop(grace=0.0)
                self._wait_end(END_WAIT)
            self._between.close()  # what the ranks printed last is written whole, what was not shown said
        return presses.count > 0

    def restart(self, devices: Optional[DeviceSpec] = None, without_failed: bool = False) -> Session:
        """Form the session again (a new run; the ranks' namespaces are lost): on the same devices,
        on ``devices``, or on the devices whose ranks did not cause the failure that ended it.

        Parameters
        ----------
        devices : str or list, optional
            A device list to form it on instead (validated as ``session()`` validates it).
        without_failed : bool, default False
            Leave out the devices of the ranks whose failure ended the session.

        Returns
        -------
        Session
            This session, with new ranks.

        Raises
        ------
        ArgumentsError
            Both ``devices`` and ``without_failed``, or ``without_failed`` when no rank failed, or
            when every rank did.
        InvalidDevicesError
            The device list failed validation (the session is left as it was).
        SessionInterrupted
            Kernel → Interrupt while the old ranks were ended: no new ones were formed.
        """
        if devices is not None and without_failed:
            raise ArgumentsError("restart() takes devices= or without_failed=True, not both")
        options = self.options
        if without_failed:
            causing = {f.rank for f in self.state.failures if not f.consequence}
            if not causing:
                raise ArgumentsError("without_failed=True: no rank's failure ended this session; restart() forms it "
                                     f"again on {', '.join(self.devices)}")
            devices = [d for rank, d in enumerate(self.devices) if rank not in causing]
            if not devices:
                raise ArgumentsError("without_failed=True: every rank of this session failed; give devices=")
            if self.options.engines is not None:  # on the engines of the ranks kept
                options = replace(self.options, engines=self.options.engines.subset(
                    [r for r in range(len(self.devices)) if r not in causing]))
        if devices is not None:  # checked before the old ranks go: a bad list loses nothing
            report = validate_for(devices, options, self._probe)
            if not report.ok:
                raise InvalidDevicesError(report)
        lost = self._run is not None and not self._closed and self._ended is None and not self._run.done
        if self._close("formed again"):
            raise SessionInterrupted("Forming the session again was interrupted: its ranks were ended, no new ones "
                                     "were formed (session.restart(), or %ddp_session --restart, forms them)")
        before, kept = self._run, (self._spec, self.options)
        old = before.id if before is not None else None
        self._spec, self.options, self._run = devices if devices is not None else self._spec, options, None
        try:
            self._start(parent=before)
        except BaseException as e:  # (an engine gone since, an interrupt): closed, its run the old or new one
            if self._run is None or isinstance(e, DDPNotebookError):
                self._run, (self._spec, self.options) = before, kept
            raise
        self._closed = False
        print(f"Session formed again on {', '.join(self.devices)}"
              + (f" (run {self._run.id}, after {old})" if old and self._run is not None else "")
              + ": the ranks' namespaces were lost" + ("" if not lost else " (the old ranks were ended)"),
              file=sys.stderr)
        return self

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _failures(self, cell: Optional[int],
                  outcome: Gathered) -> tuple[list[WorkerFailure], dict[int, Any], list[int]]:
        pids = {r: w.pid for r, w in self._run.state.workers.items() if w.pid} if self._run is not None else {}
        return failures_of(cell, outcome, self.devices, pids)

    def _error(self, cell: Optional[int], failures: list[WorkerFailure], values: dict[int, Any],
               interrupted: Iterable[int] = (), **how: Any) -> CellError:
        if self._closing:  # a cell stopped as the session closes: it does not go on
            how.update(note=f"The session is being {self._closing}.", formed_again=True)
        return cell_error(cell, failures, values, self.world_size, interrupted=list(interrupted), **how)


def _form_again_for(session: weakref.ref[Session], devices: DeviceSpec, options: LaunchOptions,
                    settings: RunSettings, parent: Run) -> Run:
    """A session's run retried (``run.retry()``, Re-form in its view): its session formed again
    on ``devices`` (a session's options stay its own); the new run."""
    s = session()
    if s is None or s._run is not parent:
        raise DDPNotebookError(f"run {parent.id} was a session's that has been formed again or closed since: "
                               "ddp_notebook.session(...) or %ddp_session forms a new one")
    s.restart(devices=devices)
    assert s._run is not None
    return s._run


def _close_ranks(formed: list[Run]) -> None:
    """A session collected without ``close()``: its ranks leave their loops (its run ends)."""
    for run in formed:
        if not run.done:
            run._tell(list(range(len(run.devices))), {"op": "close"})


@takes_launch_options
def session(devices: Optional[DeviceSpec] = None, *, probe: Optional[Probe] = None,
            **options: Unpack[LaunchKwargs]) -> Session:
    """Start ranks that stay, one per device, with their process group set up, and return once
    every rank is ready to run cells.

    A session is a launched run whose function keeps the ranks alive and runs the cells sent to
    it: a rank that dies ends it, named; the watchdog watches its cells (``stall_timeout``); a
    killed kernel leaves no rank behind.

    Parameters
    ----------
    devices : str or list, optional
        The device list, one rank per device (``"cpu*2"``, ``"cuda:0-3"``); default
        :func:`ddp_notebook.default_devices`.
    probe : Probe, optional
        Answers validation's questions about this machine (tests pass a ``StaticProbe``).
    **options
        The launch options below; with ``engines``, one rank per ipyparallel engine (the
        engines reach this notebook over TCP: it sends them its requests).

    Returns
    -------
    Session
        Ready: ``session.run(code)``, ``push``, ``pull``, ``close``, ``restart``.

    Raises
    ------
    InvalidDevicesError
        The device list failed validation; no process was started.
    LaunchOptionError
        A launch option cannot work.
    SessionEndedError
        The ranks' run ended before every rank was ready (its failure is named).

    Examples
    --------
    ::

        s = ddp_notebook.session("cpu*2")
        s.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()")   # [3.0, 3.0]
    """
    return Session(devices, options_from("session", dict(options)), probe=probe)
