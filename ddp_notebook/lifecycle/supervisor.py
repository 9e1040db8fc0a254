"""The supervision core: a run's ranks, whatever runs them, turned into events and one outcome.

A ``Supervisor`` drives an executor's ``Transport`` from the run's own thread until every rank
has ended. It owns the run's bookkeeping, written once for every executor:

- events: what the ranks report and print becomes the run's events (``emit``);
- failures, in three explicit steps. *Collect*: an error report, or an exit without one,
  becomes a ``WorkerFailure`` with an id, gathered but not yet judged. *Settle*: on the first
  failure of a run, what has already happened is made visible before anything is judged (a rank
  that dies closes its sockets before its death is visible, so a peer's knock-on error can
  arrive first: ``transport.settle``), and an error raised by the function waits up to
  ``SAME_ERROR_WINDOW`` for the other ranks' (ranks in step raise the same error within
  milliseconds, and then it is the run's error, not one rank's), unless those ranks sit idle
  (asleep, or blocked in a collective for the rank that raised: not about to raise it; their CPU
  time says so within ``IDLE_LOOK``), so that the first error reaches the notebook at once.
  *Decide*: ``order_failures``
  names the root cause among every failure known (silent deaths first, then the earliest report)
  and marks the rest as consequences; a failure seen later is judged again with the others, and
  a failure whose verdict changes is emitted again under its id;
- stopping: the first failure interrupts every peer still running, since peers blocked in a
  collective would otherwise wait out a 10-30 minute timeout; ``request_stop`` asks for a
  cooperative stop and interrupts after ``stop_grace``; an interrupted rank still running after
  ``kill_grace`` is killed (or given up on, where the executor cannot kill);
- the stall watchdog (``lifecycle.watchdog``): when no rank makes progress, it decides from the
  ranks' stacks whether one hangs, and the supervisor fails the run naming the straggler.
  Long before it may decide, a quiet run's ranks are described (``quiet`` events: where each one
  waits or runs), which never fails a run.

Time is read from an injected ``Clock`` (``lifecycle.clock``; the real one by default), so every
ordering of these steps is tested with a fake clock and a scripted transport.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..core.bounds import LINE_CHARS, bound_event, cut
from ..core.console import shown
from ..core.events import EventKind
from ..core.failures import SILENT_KINDS, FailureKind, Phase, WorkerFailure, failure_from_error, order_failures
from ..core.state import RunStatus
from ..executors.base import Exited, Observation, Output, Transport, WorkerEvent
from ..transfer.loading import Received
from .cell_phase import CellPhase, Look
from .clock import REAL_CLOCK, Clock
from .stall import collective_name, cpu_idle, is_waiting_in_collective, user_site
from .watchdog import DEFAULT_FLOOR, StallSetting, Watchdog

__all__ = ["Supervisor", "SupervisorOptions", "Outcome", "SAME_ERROR_WINDOW", "IDLE_LOOK", "PROOF_WAIT"]

log = logging.getLogger(__name__)

_DONE, _ERROR, _STOPPED = "done", "error", "stopped"  # how a rank reported its end
_FOR_THE_NOTEBOOK = (EventKind.QUEUE_PUT, EventKind.QUEUE_ASK, EventKind.SESSION)
_STDERR_KEPT = 40  # lines of each rank's stderr kept for its failure record
# Seconds the first error raised by the function waits for the other ranks' before the cause is
# named: ranks in step raise the same error within milliseconds of each other.
SAME_ERROR_WINDOW = 1.0
#: How long the ranks that did not raise are watched before they are judged idle (and the window
#: closed for them): a busy rank's CPU time grows by that much; an idle one's hardly at all.
IDLE_LOOK = 0.05
# Seconds a session's ranks outside a failed cell get to show they live (they answer in
# milliseconds; a dead one's exit is seen within that).
PROOF_WAIT = 5.0
_WINDOW_POLL = 0.05  # seconds between two looks while the window is open


@dataclass(frozen=True)
class SupervisorOptions:
    kill_grace: float = 3.0  # interrupt → kill
    stop_grace: float = 10.0  # cooperative stop → interrupt
    stall_timeout: StallSetting = None  # seconds, "auto" or None: see lifecycle.watchdog
    stall_floor: float = DEFAULT_FLOOR  # the auto watchdog's least quiet period


@dataclass(frozen=True)
class Outcome:
    """How a run ended, as the supervisor saw it."""

    status: RunStatus
    result: Optional[Received]  # the main worker's return value, as it arrived
    error: Optional[str] = None  # the supervisor's own failure, if it had one


class Supervisor:
    """Watches one run's ranks until each has ended (``supervise()``, on the run's own thread);
    reports through ``emit(event)``. ``request_stop`` and ``abandon`` may be called from any thread.

    ``labels[r]`` names rank r's device in failures; ``stack_file(r)`` is where it dumps its stacks;
    ``changed_files()`` says which files the call's data is mapped from changed since the launch
    (a rank killed by SIGBUS read one).
    """

    def __init__(self, transport: Transport, labels: Sequence[str], stack_file: Callable[[int], str],
                 options: SupervisorOptions, emit: Callable[[dict[str, Any]], None],
                 deliver: Optional[Callable[[int, dict[str, Any], Optional[Received]], None]] = None,
                 changed_files: Callable[[], list[str]] = list, clock: Clock = REAL_CLOCK) -> None:
        self.transport = transport
        self.clock = clock
        # Where what a rank sends for the notebook, not for the run, goes: an item put in a queue
        # of the call (transfer.queues), a session's answer (lifecycle.session).
        self._deliver = deliver
        self._changed_files = changed_files
        self.labels = list(labels)
        self.ranks = range(len(self.labels))
        self.options = options
        self._emit = emit
        self._commands: list[tuple[float, str, bool]] = []
        self._cmd_lock = threading.Lock()
        # A session's request in flight, judged as a phase of the run (``lifecycle.cell_phase``).
        self._phase: Optional[CellPhase] = None
        self._serving = False  # the ranks serve a session (one said hello): between requests they wait for the next
        self._looping = True  # False once the loop has ended: a phase begun then ends at once
        self._live: set[int] = set()  # the ranks that answered the last ping
        # what the ranks said
        self.pids: dict[int, Optional[int]] = {}
        self.main_ident: dict[int, int] = {}
        self.steps: dict[int, Optional[int]] = {}
        self.ready: set[int] = set()
        self.returned: set[int] = set()  # returned from the function, waiting for their peers
        self.reported: dict[int, str] = {}
        self.result: Optional[Received] = None
        self._stderr: dict[int, list[str]] = {r: [] for r in self.ranks}
        self.watchdog = Watchdog(options.stall_timeout, options.stall_floor, transport, stack_file, clock)
        # what happened to them
        self.exited: set[int] = set()
        self.failures: list[WorkerFailure] = []  # judged, in the order they were first recorded
        self.root: Optional[WorkerFailure] = None
        self._collected: list[WorkerFailure] = []  # seen, not judged yet
        self._next_id = 1
        # what we did to them
        self.stop_reason: Optional[str] = None
        self.forced: set[int] = set()  # interrupted or killed by the supervisor
        self.released = False
        self._stop_deadline: Optional[float] = None
        self._kill_deadline: dict[int, float] = {}
        self.error: Optional[str] = None
        self._notes_shown: dict[int, str] = {}  # the quiet notes last emitted

    # ---- requests from other threads ------------------------------------------------------------
    def request_stop(self, grace: float, reason: str, pruned: bool = False) -> None:
        """Ask every rank to stop (``ctx.should_stop``); interrupt those still running after ``grace``
        (``pruned``: the run's Optuna trial asked it, which its record says)."""
        with self._cmd_lock:
            self._commands.append((grace, reason, pruned))
        self.transport.wake()

    def begin_cell(self, request_id: int, cell: Optional[int], ranks: Sequence[int]) -> CellPhase:
        """A session's request ``request_id`` (cell number ``cell``, or None: a push, a pull) is
        about to go to ``ranks``: judge it as a phase of the run (``lifecycle.cell_phase``), from
        the answers that pass through here. From the session's thread, before it sends; its
        outcome's ``ended`` is set once it is judged (``gone``: the run ended first)."""
        phase = CellPhase(request_id, cell, list(ranks), len(self.ranks), self.clock.monotonic(), self.transport.wake)
        with self._cmd_lock:
            if self._looping:
                self._phase = phase
        if self._phase is not phase:
            phase.outcome.gone = True
            phase.outcome.ended.set()
        return phase

    def abandon(self) -> None:
        """The notebook process is leaving: end every rank now (their ends are ours, not failures)."""
        self.forced.update(self.ranks)
        self.transport.abandon()

    # ---- the loop -------------------------------------------------------------------------------
    def supervise(self) -> Outcome:
        try:
            while len(self.exited) < len(self.ranks):
                self._collect(self.transport.poll(self._timeout()))
                self._judge()
                self._take_commands()
                self._check_cell()
                self._check_deadlines()
                self._check_stall()
                self._check_quiet()
            self._collect(self.transport.settle([]))  # what was written after the last exit
            self._judge()
        except BaseException as exc:  # a bug here must never leave ranks behind, nor hide itself
            self.error = f"{type(exc).__name__}: {exc}"
            log.error("supervision of a run failed; its ranks are being ended", exc_info=True)
            self.transport.abandon()
        finally:
            self.transport.close()
            with self._cmd_lock:
                self._looping, phase, self._phase = False, self._phase, None
            if phase is not None:
                phase.outcome.gone = True
                phase.outcome.ended.set()
        if self.error is not None:
            self._report_own_error()
        return Outcome(self._status(), self.result, self.error)

    def _report_own_error(self) -> None:
        try:
            self._emit({"kind": EventKind.SUPERVISOR_ERROR, "time": self.clock.time(), "message": self.error})
            for rank in self.ranks:
                if rank not in self.exited:  # ended by abandon() and close()
                    self._emit({"kind": EventKind.EXITED, "time": self.clock.time(), "rank": rank,
                                "pid": self.pids.get(rank), "exit_code": None, "signal": None, "by_supervisor": True})
        except BaseException:
            log.error("the supervisor's error could not be recorded", exc_info=True)

    def _status(self) -> RunStatus:
        if self.error is not None or self.root is not None:
            return RunStatus.FAILED
        if self.stop_reason is not None:
            return RunStatus.STOPPED
        if all(self.reported.get(r) == _DONE for r in self.ranks):
            return RunStatus.SUCCEEDED
        return RunStatus.FAILED

    def _timeout(self) -> float:
        deadlines = list(self._kill_deadline.values())
        if self._stop_deadline is not None:
            deadlines.append(self._stop_deadline)
        if self._watching():
            deadlines += [d for d in (self.watchdog.deadline(), self.watchdog.note_deadline()) if d is not None]
        phase = self._phase
        phase_due = phase.deadline() if phase is not None else None
        if phase_due is not None:
            deadlines.append(phase_due)
        now = self.clock.monotonic()
        return max(0.0, min(min((d - now for d in deadlines), default=1.0), 1.0))

    def _alive(self) -> list[int]:
        return [r for r in self.ranks if r not in self.exited]

    # ---- collect: observations, in order ----------------------------------------------------------
    def _collect(self, observations: list[Observation]) -> None:
        """Handle observations in order (each rank's events keep theirs); failures are gathered
        for ``_judge``, never judged here."""
        for obs in observations:
            if isinstance(obs, WorkerEvent):
                self._on_event(obs.rank, obs.event, obs.result)
            elif isinstance(obs, Output):
                self._on_output(obs)
                phase = self._phase  # below a session's Python streams (a subprocess, native code): its cell's too
                if self._deliver is not None and self._serving:
                    cell = phase.cell if phase is not None and obs.rank in phase.ranks else None
                    self._deliver(obs.rank, {"kind": EventKind.OUTPUT, "stream": obs.stream, "cell": cell,
                                             "text": obs.text}, None)
            else:
                self._on_exited(obs)

    def _on_event(self, rank: int, event: dict[str, Any], result: Optional[Received]) -> None:
        kind = event.get("kind")
        if kind == EventKind.PONG:  # a settle's proof of life: the supervisor's alone
            self._live.add(rank)
            return
        if kind == EventKind.SESSION:
            op, phase = event.get("op"), self._phase
            self._serving = True
            if op in ("done", "error") and phase is not None and event.get("id") == phase.id and \
                    rank in phase.waiting():
                phase.answered(rank, op, bool(event.get("interrupted")), self.clock.monotonic())
                self._emit({"kind": EventKind.ANSWERED, "time": self.clock.time(), "rank": rank,
                            "status": phase.replied[rank]})
        if kind == EventKind.OUTPUT:  # what a session's rank wrote: the run's output, and its cell's
            self._on_output(Output(rank, "stderr" if event.get("stream") == "stderr" else "stdout",
                                   str(event.get("text", ""))))
            if self._deliver is not None:
                self._deliver(rank, event, None)
            return
        if kind in _FOR_THE_NOTEBOOK:  # not an event of the run
            if self._deliver is not None:
                self._deliver(rank, event, result)
            return
        event = bound_event(event)  # whatever a worker sends, the notebook holds a bounded copy
        event["rank"] = rank
        event.pop("blob", None)
        if kind == EventKind.STARTED:
            self.main_ident[rank] = event.get("main_thread", 0)
            self.pids[rank] = event.get("pid")
        elif kind == EventKind.READY:
            self.ready.add(rank)
            self.watchdog.started()
        elif kind == EventKind.RETURNED:
            self.returned.add(rank)  # waits for its peers now: never the straggler
        elif kind == EventKind.PROGRESS:
            if not event.get("held"):  # a report sent late on the watchdog's request is no progress now
                self.watchdog.progressed(rank)
            if event.get("step") is not None:
                self.steps[rank] = event["step"]
        elif kind == EventKind.DONE:
            self.reported[rank] = _DONE
            if rank == 0:
                self.result = result
        elif kind == EventKind.ERROR:
            # What a rank raises because we interrupted it (and says so) is a stop, not a failure.
            # So is what it raises after a Stop forced it (a framework that turns SIGTERM into an
            # exception: Lightning raises SIGTERMException).
            self.reported[rank] = (_STOPPED if rank in self.forced and (event.get("interrupted") or self.stop_reason)
                                   else _ERROR)
        self._emit(event)
        if kind == EventKind.ERROR and self.reported[rank] == _ERROR:
            self._collected.append(self._numbered(
                failure_from_error(event, self.labels[rank], self.pids.get(rank), self.steps.get(rank))))
        elif kind == EventKind.DONE:
            self._maybe_release()

    def _on_output(self, obs: Output) -> None:
        if obs.stream == "stderr" and obs.text:
            # As a terminal shows it: a coloured warning is text, a progress bar redrawn with carriage
            # returns is one line (splitlines() would cut it at each \r, one line per redraw).
            lines = obs.text[:-1].split("\n") if obs.text.endswith("\n") else obs.text.split("\n")
            kept = self._stderr[obs.rank]
            kept.extend(cut(shown(line), LINE_CHARS) for line in lines)
            del kept[:-_STDERR_KEPT]
        self._emit(bound_event({"kind": EventKind.OUTPUT, "time": self.clock.time(), "rank": obs.rank,
                                "stream": obs.stream, "text": obs.text}))

    def _on_exited(self, obs: Exited) -> None:
        rank = obs.rank
        if rank in self.exited:
            return
        self.exited.add(rank)
        self._kill_deadline.pop(rank, None)
        if self.pids.get(rank) is None:
            self.pids[rank] = obs.pid
        # Ours only when it ended the way we end ranks: a worker already dying of its own crash
        # when it was interrupted keeps its own death (SIGSEGV, os._exit(3), ...).
        ours = obs.signal in self.transport.forced_signals or (obs.signal is None and not obs.code)
        by_us = obs.lost is None and rank in self.forced and (
            self.reported.get(rank) == _STOPPED or (rank not in self.reported and ours))
        self._emit({"kind": EventKind.EXITED, "time": self.clock.time(), "rank": rank, "pid": self.pids[rank],
                    "exit_code": obs.code, "signal": obs.signal, "by_supervisor": by_us})
        # A rank that returned dies of a signal not ours while it waits for its peers (the
        # out-of-memory killer, a kill): its death is the run's failure, named now, not a quiet
        # end that leaves the run "running" until the others return and then "succeeded".
        died_after_returning = (self.reported.get(rank) == _DONE and not self.released and obs.lost is None
                                and obs.signal is not None and not (rank in self.forced and ours))
        if by_us or (rank in self.reported and not died_after_returning):
            return
        if obs.lost is not None:
            kind = obs.lost_kind
        elif obs.signal is not None or (obs.code is not None and obs.code < 0):
            kind = FailureKind.SIGNAL
        else:
            kind = FailureKind.EXIT
        message = obs.lost or ""
        if obs.signal == "SIGBUS":  # a mapped file read past its end: the call's, when one of them changed
            changed = self._changed_files()
            if changed:
                message = ("it read data of the call from a file that changed while the run used it "
                           f"({'; '.join(changed)})")
        self._collected.append(self._numbered(WorkerFailure(
            rank=rank, device=self.labels[rank], kind=kind, time=self.clock.time(), pid=self.pids[rank],
            phase=Phase.RUN if rank in self.ready else Phase.STARTUP, exit_code=obs.code, signal=obs.signal,
            message=message, last_step=self.steps.get(rank))))

    def _numbered(self, failure: WorkerFailure) -> WorkerFailure:
        failure.id, self._next_id = self._next_id, self._next_id + 1
        return failure

    # ---- settle and decide ----------------------------------------------------------------------
    def _judge(self) -> None:
        """Judge the failures collected: on a run's first, settle first (see the module's doc);
        then decide the root cause among all of them."""
        if not self._collected:
            return
        if self.root is None:
            self._settle()
        found, self._collected = self._collected, []
        self._decide(found)

    def _settle(self) -> None:
        """Make visible what has already happened, and give an error every rank may raise
        ``SAME_ERROR_WINDOW`` to be raised by all, collecting as it goes."""
        silent = [r for r in self.ranks if r not in self.reported and r not in self.exited]
        self._collect(self.transport.settle(silent))
        first = self._collected[0]
        # A death says nothing of the others, except the fork server's: it ended every worker it
        # forked, and their exits are seen one by one (within milliseconds). A stall is decided.
        if (first.kind in SILENT_KINDS and first.kind != FailureKind.SERVER) or first.kind == FailureKind.STALL:
            return
        deadline = self.clock.monotonic() + SAME_ERROR_WINDOW
        look: Optional[tuple[float, dict[int, Optional[float]]]] = None  # when, and the ranks' CPU seconds then
        while True:
            waiting = [r for r in self.ranks if r not in self.reported and r not in self.exited]
            now = self.clock.monotonic()
            left = deadline - now
            if not waiting or left <= 0 or any(not first.same_error_as(f) for f in self._collected):
                return
            if look is not None and now - look[0] >= 0.9 * IDLE_LOOK:  # (a poll may return a hair early)
                cpu = self.transport.cpu_seconds(waiting)
                # None of them computes, so none is about to raise it too: once each shows it lives
                # (a dying rank, idle too, may not show its end yet), the first error is judged.
                if all(cpu_idle(look[1].get(r), cpu.get(r), now - look[0]) for r in waiting):
                    self._prove_alive(waiting, deadline)
                    return
                look = (now, cpu)
            elif look is None:
                look = (now, self.transport.cpu_seconds(waiting))
            self._collect(self.transport.poll(min(left, _WINDOW_POLL, IDLE_LOOK)))

    # ---- a session's request: a phase of the run -------------------------------------------------
    def _check_cell(self) -> None:
        """Judge the session's request in flight (``lifecycle.cell_phase``): interrupt the ranks
        to interrupt, look at those left in a cell, settle once a rank raised; end it when judged."""
        phase = self._phase
        if phase is None:
            return
        now = self.clock.monotonic()
        interrupt = phase.to_interrupt(now)
        if interrupt:
            self.transport.send(interrupt, {"op": "interrupt", "cell": phase.cell})
            self._emit({"kind": EventKind.INTERRUPTING, "time": self.clock.time(), "ranks": interrupt})
        if phase.waiting():
            if not phase.stuck(now):
                looked = phase.look_due(now)
                if looked:
                    phase.looked(self._look(looked))
                if not phase.left_waiting(self.clock.monotonic()):
                    return
        elif phase.first_error is not None:
            self._settle_cell(phase.outside())
        with self._cmd_lock:
            self._phase = None
        phase.outcome.ended.set()
        if self._deliver is not None:  # the session's thread may wait for its next answer: wake it
            self._deliver(-1, {"kind": EventKind.SESSION, "op": "judged"}, None)

    def _look(self, ranks: list[int]) -> Look:
        """Where ``ranks`` wait (their stacks, as the watchdog dumps them) and their CPU time."""
        frames, cpu = self.watchdog.sample(ranks, self.main_ident)
        places: dict[int, tuple[str, ...]] = {r: (collective_name(f), user_site(f) or "?")
                                              if is_waiting_in_collective(f) else () for r, f in frames.items()}
        return Look(self.clock.monotonic(), places, cpu)

    def _settle_cell(self, live: list[int]) -> None:
        """Settle a request in which a rank raised: what has happened made visible, the ranks
        ``live`` (outside the request) pinged until each answers, which a dying rank cannot (its
        pipes may close after its peers saw its sockets close), or one of them ends, within
        ``PROOF_WAIT``; then judged. A death found is the run's failure, and its cause."""
        self._collect(self.transport.settle([r for r in self._alive() if r not in self.reported]))
        self._prove_alive(live, self.clock.monotonic() + PROOF_WAIT)
        self._judge()

    def _prove_alive(self, ranks: list[int], deadline: float) -> None:
        """Ping ``ranks`` and collect until each answers from its lifeline's thread (which a dying
        rank cannot), one of them ends, or ``deadline``."""
        asked = [r for r in ranks if r not in self.exited]
        self._live -= set(asked)
        if not asked:
            return
        try:
            self.transport.send(asked, {"op": "ping"})  # one it cannot reach has ended: its exit shows
        except NotImplementedError:  # no way to ask (engines): nothing proven
            return
        while not self._live.issuperset(asked) and not self.exited.intersection(asked):
            left = deadline - self.clock.monotonic()
            if left <= 0:
                break
            self._collect(self.transport.poll(min(left, _WINDOW_POLL)))

    def _decide(self, found: list[WorkerFailure]) -> None:
        """Name the root cause among every failure known, record the new ones and those whose
        verdict changed (under the same id), and interrupt the peers once the run has failed."""
        before = {f.id: (f.consequence, tuple(f.same_on)) for f in self.failures}
        ordered = order_failures(self.failures + found, len(self.ranks))
        self.root = ordered[0]
        for failure in ordered:
            if failure.id not in before or before[failure.id] != (failure.consequence, tuple(failure.same_on)):
                self._record(failure)
        self._force(self._alive())

    def _record(self, failure: WorkerFailure) -> None:
        if not any(f is failure for f in self.failures):
            failure.stderr_tail = list(self._stderr[failure.rank])
            self.failures.append(failure)
        self._emit({"kind": EventKind.FAILURE, "time": self.clock.time(), "rank": failure.rank,
                    "failure": failure.to_dict()})

    # ---- stopping -------------------------------------------------------------------------------
    def _force(self, ranks: list[int]) -> None:
        """Interrupt ``ranks`` not interrupted yet now, kill them after ``kill_grace``."""
        ranks = [r for r in ranks if r not in self.forced]
        if not ranks:
            return
        self.forced.update(ranks)
        # A rank that reported an error is already leaving.
        leaving = [r for r in ranks if self.reported.get(r) != _ERROR]
        if leaving:
            self.transport.interrupt(leaving)
        deadline = self.clock.monotonic() + self.options.kill_grace
        for rank in ranks:
            self._kill_deadline[rank] = deadline

    def _maybe_release(self) -> None:
        if (not self.released and self.root is None and not self._collected
                and all(self.reported.get(r) == _DONE for r in self.ranks)):
            self.released = True
            self.transport.release(list(self.ranks))

    def _take_commands(self) -> None:
        with self._cmd_lock:
            commands, self._commands = self._commands, []
        for grace, reason, pruned in commands:
            alive = self._alive()
            if self.stop_reason is None and self.root is None and not self.released and alive:
                self.stop_reason = reason
                self._emit({"kind": EventKind.STOPPING, "time": self.clock.time(), "reason": reason,
                            **({"pruned": True} if pruned else {})})
                self.transport.request_stop(alive)
                # No worker exists yet (the fork server still imports torch): none needs a grace.
                self._stop_deadline = self.clock.monotonic() + (grace if self.transport.started() else 0.0)
            elif self._stop_deadline is not None:  # asked again, sooner (a second interrupt): the sooner wins
                self._stop_deadline = min(self._stop_deadline, self.clock.monotonic() + grace)

    def _check_deadlines(self) -> None:
        now = self.clock.monotonic()
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self._stop_deadline = None
            if not self.released:
                # Ranks that returned may leave; the others are interrupted.
                self.transport.release([r for r in self._alive() if self.reported.get(r) == _DONE])
                self._force(self._alive())
        for rank, deadline in list(self._kill_deadline.items()):
            if now >= deadline and rank not in self.exited:
                del self._kill_deadline[rank]
                self.transport.kill([rank])

    # ---- the stall watchdog ---------------------------------------------------------------------
    def _watching(self) -> bool:
        """Whether the run's progress is watched: not once it failed, a stop was asked, or every rank is done."""
        return self.root is None and not self._collected and self.stop_reason is None and not self.released

    def _inside(self) -> tuple[list[int], list[int]]:
        """The ranks inside the function (a rank that returned waits for its peers, never the
        straggler), and those that left it (a peer may wait for them)."""
        alive = [r for r in self._alive() if r not in self.reported and r not in self.returned]
        left = self.returned | {r for r, how in self.reported.items() if how == _DONE}
        return alive, sorted(left)

    def _check_quiet(self) -> None:
        """Say where each rank of a quiet run waits or runs (a ``quiet`` event when that changes;
        empty notes once progress resumes or the run is no longer watched). A description only:
        whatever goes wrong here is logged, and the run goes on."""
        notes: dict[int, str] = {}
        if self._watching():
            alive, left = self._inside()
            if self._serving and self._phase is None:  # a session's ranks between requests: none is quiet, all wait
                alive = []
            try:
                notes = self.watchdog.quiet_notes(alive, self.main_ident, left)
            except Exception:  # a description must never end a run
                log.warning("the quiet ranks of a run could not be described", exc_info=True)
                notes = {}
        if notes == self._notes_shown:
            return
        self._notes_shown = dict(notes)
        idle = None if self.watchdog.quiet_since is None else self.clock.monotonic() - self.watchdog.quiet_since
        self._emit({"kind": EventKind.QUIET, "time": self.clock.time(), "idle": idle if notes else None,
                    "notes": {str(r): text for r, text in notes.items()}})

    def _check_stall(self) -> None:
        if not self._watching():
            return
        alive, left = self._inside()
        found, stacks = self.watchdog.check(alive, self.steps, self.main_ident, {r: self.labels[r] for r in alive},
                                            {r: self.pids.get(r) for r in alive}, left)
        if not found:
            return
        self._emit({"kind": EventKind.STALLED, "time": self.clock.time(), "ranks": [f.rank for f in found],
                    "idle": found[0].stalled_for, "stacks": {str(r): text for r, text in stacks.items()}})
        self._decide([self._numbered(f) for f in found])  # decided by the stacks: nothing to settle
