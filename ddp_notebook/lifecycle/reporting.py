"""What the notebook does with every value rank 0 logs, off the run's own thread: forward it to
the run's trackers (``lifecycle.trackers``) and report the monitored one to an Optuna trial, which
may prune the run.

The ranks send every value they log (``points`` of their progress reports, see
``worker.loss_history``); the run's event stream hands them to the ``Reporter`` on the
supervisor's thread, which only queues them: trackers are called from the reporter's own thread,
so one that is slow never slows the run, and one that is missing or fails is said in one line
(a ``tracker`` event) and left out; the trial is told from a thread of its own, so a tracker slow
to start or to take values never holds the pruning back. At the end of the run its trackers are
told its status, and the run waits for them a bounded time.
"""
from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from ..core.bounds import cut_middle
from ..core.errors import LaunchOptionError
from ..core.events import NOT_FINITE, EventKind
from ..core.experiment import summarize
from ..core.stream import EventStream
from .options import RunSettings
from .trackers import Point, RunRecord, Tracker, make_trackers

__all__ = ["Reporter", "reporter_of", "check_trial", "trial_direction", "trial_config", "FINISH_WAIT", "PENDING_VALUES",
           "CPU_SHARE", "PART"]

log = logging.getLogger(__name__)

FINISH_WAIT = 10.0
"""Seconds the end of a run waits for its trackers to take the last values and its status."""
PART = 500
"""Points a tracker is given in one call at most (the notebook's exit cuts a backlog between two)."""
PENDING_VALUES = 200_000
"""Values waiting for the trackers at most; past it, new ones are not sent (and the panel says so)."""
CPU_SHARE = 0.02
"""The share of one core the trackers take at most while the run goes on (the rest at its end)."""
MAX_REST = 5.0  # seconds the trackers' thread rests at most after a batch

_END = object()


def check_trial(trial: Any, caller: str) -> None:
    """Refuse what is not an Optuna trial that takes reports (a ``Trial`` or ``FixedTrial``)."""
    if trial is None:
        return
    import sys

    optuna = sys.modules.get("optuna")  # a trial exists only where optuna was imported
    trial_types = (optuna.trial.Trial, optuna.trial.FixedTrial) if optuna is not None else ()
    if not trial_types or not isinstance(trial, trial_types):
        raise LaunchOptionError(f"{caller}()'s trial must be the optuna.trial.Trial your objective is given (it "
                                f"reports to it and may be pruned), not {type(trial).__name__} {trial!r:.80}")
    study = getattr(trial, "study", None)
    if study is not None and len(study.directions) > 1:
        raise LaunchOptionError(f"{caller}()'s trial belongs to a study with {len(study.directions)} objectives: "
                                "Optuna prunes only single-objective studies (leave trial= out and return the values)")


def trial_direction(trial: Any) -> Optional[str]:
    """``"min"`` or ``"max"``: what the trial's study counts as better (None for a ``FixedTrial``)."""
    study = getattr(trial, "study", None)
    if study is None:
        return None
    return "max" if study.direction.name == "MAXIMIZE" else "min"


def trial_config(trial: Any) -> dict[str, Any]:
    """What a run's config records of its trial: the study's name, the trial's number and each of
    its parameters as ``trial.<name>`` (``{}`` without a trial)."""
    if trial is None:
        return {}
    study = getattr(trial, "study", None)
    out: dict[str, Any] = {"study": study.study_name} if study is not None else {}
    if getattr(trial, "number", None) is not None:
        out["trial"] = trial.number
    out.update({f"trial.{k}": summarize(v) for k, v in dict(trial.params).items()})
    return out


class Reporter:
    """Forwards rank 0's values to ``trackers`` from a thread of its own, and the monitored value to
    ``trial`` from another (a tracker slow to start or to take values never holds the pruning back).

    ``on_event`` is the run stream's subscriber; ``emit`` says a tracker's trouble in the run's
    events; ``prune(reason)`` stops the run when the trial's pruner says so; ``verdict(epoch)``
    tells the ranks an epoch's value was taken, and the run goes on (a fit waits for it before
    its next epoch).
    """

    def __init__(self, record: RunRecord, trackers: Sequence[Tracker], emit: Callable[[dict[str, Any]], None],
                 trial: Any = None, monitor: Optional[str] = None,
                 prune: Callable[[str], None] = lambda reason: None,
                 verdict: Callable[[int], None] = lambda epoch: None) -> None:
        self.record = record
        self.trackers = list(trackers)
        self._emit = emit
        self.trial = trial if monitor is not None else None
        self.monitor = monitor
        self._prune = prune
        self._verdict = verdict
        self.pruned = False
        self.prune_reason = ""  # why, once pruned
        self._judging = self.trial is not None
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._ending = threading.Event()  # the run has ended: the trackers take what is left at once
        self._cut_at = math.inf  # when the values still waiting are left out (the notebook exits)
        self._background = threading.Event()  # its end no longer waits for them: back to their share
        self._trial_queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending = 0
        self._dropped = 0
        self._count = 0  # rank 0's values seen: the step of one logged without a step
        self._lock = threading.Lock()
        self._reported: set[int] = set()  # the trial's steps reported (Optuna keeps the first value of a step)
        self._names: set[str] = set()  # what rank 0 logged, to name when the monitored value never came
        self._busy: Optional[str] = None  # the tracker being called now, by label
        self._threads: list[tuple[threading.Thread, str]] = []  # each with what it serves
        if self.trackers:
            self._threads.append((threading.Thread(target=self._run, name=f"ddp-report-{record.run_id}",
                                                   daemon=True), "trackers"))
        if self.trial is not None:
            self._threads.append((threading.Thread(target=self._run_trial, name=f"ddp-trial-{record.run_id}",
                                                   daemon=True), "trial"))
        for thread, _ in self._threads:
            thread.start()

    # ---- the supervisor's thread: queue only -----------------------------------------------------
    def on_event(self, event: dict[str, Any]) -> None:
        # Once the run's end is told (``finish``), what still comes is not the run's (a notebook
        # that exits ends its ranks after it wrote their end).
        if event.get("kind") != EventKind.PROGRESS or event.get("rank") != 0 or self._ending.is_set():
            return
        raw = event.get("points")
        if not isinstance(raw, list) or not raw:
            return
        points: list[tuple[Point, Optional[int]]] = []
        values_in = 0
        with self._lock:
            for item in raw:
                if not isinstance(item, list) or len(item) != 4 or not isinstance(item[3], dict):
                    continue
                self._count += 1
                t, step, epoch, values = item
                at = step if isinstance(step, int) and not isinstance(step, bool) else self._count
                # A non-finite number travels as its text (JSON has none): to the trackers, the number.
                values = {k: float(v) if v in NOT_FINITE else v for k, v in values.items()}
                values_in += len(values)
                points.append(((at, float(t), values), epoch if isinstance(epoch, int) else None))
            if self._judging:  # (a trial whose storage failed is None: its epochs are still said to the ranks)
                self._trial_queue.put(points)
            if not self.trackers:
                return
            if self._pending + values_in > PENDING_VALUES:
                self._dropped += values_in
                return
            self._pending += values_in
        self._queue.put((points, values_in))

    def finish(self, status: str, summary: dict[str, Any], wait: Optional[float] = None, last: bool = False) -> None:
        """Tell the trackers the run ended (``status``, ``summary``: its final metrics), waiting at
        most ``wait`` seconds (default ``FINISH_WAIT``) for them and the trial; one still busy then
        goes on in the background, said so. ``last``: the notebook process exits, there is no
        background: the values still waiting after half of ``wait`` are left out (counted), so that
        the trackers are told the end in time."""
        wait = FINISH_WAIT if wait is None else max(0.0, wait)
        if last:
            self._cut_at = time.monotonic() + wait / 2
        self._ending.set()
        self._queue.put((_END, status, summary))
        self._trial_queue.put((_END, status, summary))
        deadline = time.monotonic() + wait
        for thread, _ in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        busy = [(self._busy or "the trackers") if serves == "trackers" else "the Optuna trial"
                for thread, serves in self._threads if thread.is_alive()]
        if busy:
            self._background.set()  # from now on at its share of a core again: other runs may train
            what = " and ".join(busy)
            self._note(what, f"{what} still busy {wait:g} s after the run ended: it goes on in the background")

    def check_pruned(self, run_id: str) -> None:
        """``optuna.TrialPruned`` when the trial was pruned though the run ran to its end (the
        pruner said so after the ranks had left: at the last epoch, or a loop faster than it)."""
        if self.pruned:
            import optuna  # the run had a trial: optuna is imported

            raise optuna.TrialPruned(f"run {run_id} ran to its end, but its trial was {self.prune_reason}")

    # ---- the reporter's threads -----------------------------------------------------------------
    def _note(self, label: str, message: str) -> None:
        self._emit({"kind": EventKind.TRACKER, "time": time.time(), "tracker": label, "message": message})

    def _call(self, tracker: Tracker, what: str, *args: Any) -> None:
        """``tracker.<what>(*args)``; a failure leaves the tracker out, said once."""
        if tracker not in self.trackers:
            return
        self._busy = tracker.label
        try:
            getattr(tracker, what)(*args)
        except ImportError as e:
            self._drop(tracker)
            self._note(tracker.label, f"report_to={tracker.label!r} needs {e.name or 'a missing library'} "
                                      f"({tracker.needs or 'install it'}): the run goes on without it")
        except BaseException as e:  # whatever a tracker raises (even SystemExit, on this thread), the run goes on
            self._drop(tracker)
            log.debug("tracker %s failed", tracker.label, exc_info=True)
            # (its head and its end: a library's remedy is often said last)
            self._note(tracker.label, cut_middle(f"{tracker.label} failed in {what}(): {type(e).__name__}: {e}", 600)
                       + "; nothing more is sent to it")
        finally:
            self._busy = None

    def _drop(self, tracker: Tracker) -> None:
        with self._lock:
            self.trackers = [t for t in self.trackers if t is not tracker]

    def _run(self) -> None:
        """The trackers' thread: start them, give them every value, finish them. While the run
        goes on it takes at most ``CPU_SHARE`` of a core: a tracker that costs CPU (MLflow's SQL
        store takes about 0.2 ms a value) would take it from ranks that use every core (a nice
        value cannot protect them: each rank is a session, with a scheduling group of its own).
        What it leaves waits, and is sent in larger batches, or at the end."""
        used = time.thread_time()
        for tracker in list(self.trackers):
            self._call(tracker, "start", self.record)
        self._rest(time.thread_time() - used)
        while True:
            item = self._queue.get()
            batch: list[tuple[Point, Optional[int]]] = []
            end = None
            taken = 0
            while True:  # whatever waits goes in one call to each tracker
                if item[0] is _END:
                    end = item
                    break
                batch += item[0]
                taken += item[1]
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
            if batch:
                with self._lock:
                    self._pending -= taken
                points = [p for p, _epoch in batch]
                used = time.thread_time()
                # In parts: as the notebook exits, once half its time is spent, the rest is left out
                # (counted): the end must not wait behind a backlog.
                for at in range(0, len(points), PART):
                    if time.monotonic() >= self._cut_at:
                        self._dropped += sum(len(values) for _step, _t, values in points[at:])
                        break
                    for tracker in list(self.trackers):
                        self._call(tracker, "log", points[at:at + PART])
                self._rest(time.thread_time() - used)
            if end is not None:
                _, status, summary = end
                if self._dropped:
                    self._note("trackers", f"the trackers fell behind: {self._dropped} values were not sent to them")
                for tracker in list(self.trackers):
                    self._call(tracker, "finish", status, summary)
                return

    def _rest(self, used: float) -> None:
        """Rest in proportion to the CPU time just ``used``: while the run goes on (its end wakes
        it: the end waits for the trackers, which catch up at once), and again once the end no
        longer waits for them (what is left then goes on in the background at their share)."""
        delay = min(used * (1 / CPU_SHARE - 1), MAX_REST)
        if self._background.is_set():
            time.sleep(delay)
        else:
            self._ending.wait(delay)

    def _run_trial(self) -> None:
        """The trial's thread: the monitored value as it comes; at the end, a line if it never came."""
        while True:
            item = self._trial_queue.get()
            if isinstance(item, tuple) and item and item[0] is _END:
                if self.trial is not None and not self._reported:
                    logged = ", ".join(sorted(self._names)[:20]) or "no number"
                    self._note("trial", f"the Optuna trial was told nothing: rank 0 never logged a finite number "
                                        f"as {self.monitor!r} (it logged {logged})")
                return
            self._report(item)

    def _report(self, batch: list[tuple[Point, Optional[int]]]) -> None:
        """The monitored value to the trial, at its epoch when logged in one (else its step), and
        the run pruned when the trial's pruner says so."""
        if self.monitor is None or self.pruned:
            return
        for (step, _t, values), epoch in batch:
            value = values.get(self.monitor)
            number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            if not number and len(self._names) < 100:
                self._names.update(values)
            if value is None:
                continue
            at = epoch if epoch is not None else step
            # Reported once a step; not a number (the fit itself says so), or a trial whose storage
            # failed: the run goes on all the same.
            if number and self.trial is not None and at not in self._reported:
                self._reported.add(at)
                try:
                    self.trial.report(float(value), at)
                    prune = self.trial.should_prune()
                except Exception as e:  # noqa: BLE001 - a storage that fails: the run goes on, said once
                    self._note("trial", f"reporting to the Optuna trial failed: {type(e).__name__}: {e}"[:500])
                    self.trial, prune = None, False
                if prune:
                    self.pruned = True
                    where = f"epoch {epoch + 1}" if epoch is not None else f"step {step}"
                    self.prune_reason = (f"pruned by Optuna (trial {getattr(self.trial, 'number', '?')}, at "
                                         f"{where}: {self.monitor} {value:.4g})")
                    self._prune(self.prune_reason)
                    return
            if epoch is not None:
                self._verdict(epoch)


def reporter_of(stream: EventStream, report_to: Any, settings: RunSettings, ranks: int, tell: Callable[..., Any],
                prune: Callable[[str], None]) -> Optional[Reporter]:
    """The reporter of a run starting (None: no tracker and no trial), fed from its first report on:
    ``tell(ranks, request)`` says each epoch the trial judged to the ranks (a fit's next epoch waits
    for it; another loop's ranks drop it), ``prune(reason)`` stops the run."""
    if not report_to and settings.trial is None:
        return None
    state = stream.state
    record = RunRecord(state.run_id, state.run_dir or "", state.name, dict(state.tags), dict(state.config))

    def verdict(epoch: int) -> None:
        try:
            tell(range(ranks), {"op": "verdict", "epoch": epoch})
        except NotImplementedError:  # ranks that take no request (on engines, but a session's): none waits
            pass

    reporter = Reporter(record, make_trackers(report_to), stream.emit, trial=settings.trial, monitor=settings.monitor,
                        prune=prune, verdict=verdict)
    stream.subscribe(reporter.on_event)
    return reporter
