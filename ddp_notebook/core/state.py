"""The state of a run as a pure fold of its events.

Every front end (text view, widget panel, magics) renders a ``RunState``; tests build one by
feeding events. No torch, no IPython, no threads here.

>>> s = RunState()
>>> s.apply({"kind": "run_started", "time": 0.0, "run_id": "r1", "devices": ["cpu:0", "cpu:1"]})
>>> s.apply({"kind": "ready", "time": 0.5, "rank": 1})
>>> s.apply({"kind": "progress", "time": 1.0, "rank": 1, "step": 3, "total": 10, "metrics": {"loss": 0.5}})
>>> s.workers[1].step, s.workers[1].metrics["loss"], s.status
(3, 0.5, 'running')
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from ._text import TextEnum
from .bounds import LINE_CHARS, METRICS_KEPT, cut
from .console import ConsoleLines
from .events import NOT_FINITE, EventKind
from .failures import WorkerFailure

__all__ = ["CellRecord", "RequestState", "DataState", "RunState", "WorkerState", "RunStatus", "WorkerStatus",
           "OUTPUT_LINES_KEPT", "SERIES_KEPT", "CELLS_KEPT",
           "train_loss_of", "valid_loss_of", "epoch_row", "epoch_label"]

OUTPUT_LINES_KEPT = 500  # per rank in memory; the event log on disk keeps everything
LOSS_POINTS_KEPT = 2000  # per rank, for the loss plot; older points are thinned out, not dropped
EPOCHS_KEPT = 1000  # per rank, the epoch records of the epoch table (the first ones and the latest)
# A running rank silent for longer than SILENCE_FACTOR times its usual gap between reports (and at
# least SILENCE_FLOOR seconds) is shown as making no progress. Shown only: it never fails a run.
SILENCE_FLOOR = 30.0
RATE_WINDOW = 1.0  # seconds: a rank's step rate is measured over windows at least this long
SILENCE_FACTOR = 10.0
SERIES_KEPT = 2000  # points per metric of rank 0's record (every value logged; past this, every other one)
CELLS_KEPT = 500  # a session's latest cells a state holds (the log has every one)
CELL_VALUES_KEPT = 64  # ranks' values in words a cell's record holds
TRACKER_NOTES_KEPT = 20  # lines about the run's trackers (one per tracker that fails, falls behind...)
TRAIN_LOSS = ("train_loss",)
VALID_LOSS = ("valid_loss", "val_loss")


def train_loss_of(record: dict[str, Any]) -> Optional[float]:
    """An epoch's train loss: the one logged (``train_loss``, fit's cross-rank mean), else the mean
    of the step losses logged in it."""
    metrics = record.get("metrics") or {}
    for name in TRAIN_LOSS:
        if name in metrics:
            return metrics[name]
    return record.get("loss_mean")


def valid_loss_of(record: dict[str, Any]) -> Optional[float]:
    """An epoch's validation loss (``valid_loss`` or ``val_loss``), when one was logged."""
    metrics = record.get("metrics") or {}
    return next((metrics[name] for name in VALID_LOSS if name in metrics), None)


def epoch_row(record: dict[str, Any]) -> dict[str, Any]:
    """An epoch record as a row of ``Run.history``: ``epoch`` (from 0), ``train_loss`` (logged, or
    the mean of the epoch's step losses), every number logged in the epoch, ``seconds``.

    >>> epoch_row({"epoch": 0, "seconds": 2.5, "metrics": {"valid_loss": 0.4}, "loss_mean": 0.5, "losses": 10})
    {'epoch': 0, 'train_loss': 0.5, 'valid_loss': 0.4, 'seconds': 2.5}
    """
    row: dict[str, Any] = {"epoch": record.get("epoch")}
    train = train_loss_of(record)
    if train is not None:
        row["train_loss"] = train
    row.update((k, v) for k, v in (record.get("metrics") or {}).items() if k not in row)
    row["seconds"] = record.get("seconds")
    return row


class RunStatus(TextEnum):
    """Where a run is: ``Run.status``. Each member equals its text (``run.status == "failed"``).

    >>> RunStatus.FAILED == "failed", RunStatus.FAILED.finished
    (True, True)
    """

    #: Validating, sending the call, starting the workers.
    STARTING = "starting"
    #: Every worker started; the function runs.
    RUNNING = "running"
    #: Every worker returned; ``Run.wait()`` gives the main worker's value.
    SUCCEEDED = "succeeded"
    #: A worker failed (``Run.root_failure`` says which and why); the others were ended.
    FAILED = "failed"
    #: Stopped by ``Run.stop()``, the panel's Stop, an interrupt, or the notebook's end.
    STOPPED = "stopped"

    @property
    def finished(self) -> bool:
        """True for the three endings: succeeded, failed, stopped."""
        return self in (RunStatus.SUCCEEDED, RunStatus.FAILED, RunStatus.STOPPED)


class WorkerStatus(TextEnum):
    """Where one rank is: ``WorkerState.status``. Each member equals its text."""

    #: The process started; the function is not called yet.
    STARTING = "starting"
    #: In the function.
    RUNNING = "running"
    #: Returned from the function.
    SUCCEEDED = "succeeded"
    #: Failed (its ``WorkerFailure`` is among the run's failures).
    FAILED = "failed"
    #: Ended by the supervisor (a peer failed, a stop), or returned once a stop was asked.
    STOPPED = "stopped"


def epoch_label(epoch: Any, epochs: Optional[int]) -> str:
    """An epoch as every view shows it: counted from 1 of ``epochs`` when their number is known,
    else as reported. Epochs are counted from 0 (``ctx.epochs``' own); one logged from 1 reaches
    ``epochs`` and is shown as the last, never as one past it (8/8, not 9/8).

    >>> epoch_label(2, 8), epoch_label(2, None), epoch_label(8, 8)
    ('3/8', '2', '8/8')
    """
    if not epochs or not isinstance(epoch, int) or isinstance(epoch, bool):
        return str(epoch)
    return f"{min(epoch, epochs - 1) + 1}/{epochs}"


@dataclass
class WorkerState:
    """What is known about one rank."""

    rank: int
    device: str
    place: Optional[str] = None  # where the rank runs when not in a local process: "engine 1 on host-a"
    host: Optional[str] = None  # the rank's host, for runs whose ranks may be on several (engines)
    pid: Optional[int] = None
    status: WorkerStatus = WorkerStatus.STARTING
    step: Optional[int] = None
    total: Optional[int] = None
    epoch: Optional[int] = None
    epochs: Optional[int] = None  # how many epochs, when the rank runs ctx.epochs(n)
    metrics: dict[str, Any] = field(default_factory=dict)
    started_at: Optional[float] = None
    last_progress_at: Optional[float] = None
    ended_at: Optional[float] = None
    exit_code: Optional[int] = None
    returned: bool = False
    knock_on: bool = False  # it failed because another rank's failure ended the run (a consequence)
    ready_at: Optional[float] = None
    typical_gap: Optional[float] = None  # a moving average of the seconds between two progress reports
    rate: Optional[float] = None  # steps per second, a moving average over windows of at least RATE_WINDOW s
    _rate_anchor: Optional[tuple[float, int]] = field(default=None, repr=False)  # (time, step) the window began
    output: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=OUTPUT_LINES_KEPT))
    console: ConsoleLines = field(default_factory=ConsoleLines, repr=False)  # output as a terminal shows it
    output_lines: int = 0  # lines it printed in all (``output`` keeps the latest)
    loss_history: list[tuple[float, float]] = field(default_factory=list)  # (step, loss) points for the plot
    # While the run is quiet: where this rank waits or runs ("waits in all_reduce (train.py:9) for
    # rank 1", "runs at train.py:12, 100 % CPU"), refreshed while the quiet lasts; None otherwise.
    note: Optional[str] = None
    # The rank sends its step losses binned (worker/loss_history.py): then a report's own loss is
    # not plotted, it is among the bins.
    loss_binned: bool = False
    # The bin still filling when the last report was sent (its mean so far): the plot draws it after
    # the closed ones, so it shows the latest step while a rank is quiet, not the one before.
    loss_open: Optional[tuple[float, float]] = None
    # One record per epoch, in order: {"epoch", "seconds", "metrics": {name: last value logged in
    # the epoch}, "loss_mean": mean step loss, "losses": how many}; the latest may still be open.
    epoch_history: list[dict[str, Any]] = field(default_factory=list)
    peak_rss: Optional[int] = None  # the rank's largest resident memory so far (bytes)
    peak_cuda: Optional[int] = None  # on a GPU: torch.cuda.max_memory_allocated (bytes)

    @property
    def loss_points(self) -> list[tuple[float, float]]:
        """The points of this rank's loss plot: the closed bins, then the one still filling."""
        return self.loss_history + ([self.loss_open] if self.loss_open is not None else [])

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def finished(self) -> bool:
        return self.status in (WorkerStatus.SUCCEEDED, WorkerStatus.FAILED, WorkerStatus.STOPPED)

    @property
    def label(self) -> str:
        """The device, and the engine for a rank on one: ``cpu:1`` or ``cpu:1 on engine 1 on host-a``."""
        return f"{self.device} on {self.place}" if self.place else self.device

    @property
    def shown_status(self) -> str:
        """The status to show: ``knock-on`` for a rank that failed only because another did."""
        return "knock-on" if self.status == WorkerStatus.FAILED and self.knock_on else str(self.status)

    @property
    def last_line(self) -> str:
        """The last line the worker printed (stdout or stderr)."""
        return self.output[-1][1] if self.output else ""

    def silent_for(self, now: float) -> Optional[float]:
        """Seconds this running rank has gone without a progress report (since it was ready, before
        its first), when that is well over its usual gap; else None.

        >>> w = WorkerState(0, "cpu:0", status=WorkerStatus.RUNNING, ready_at=0.0, last_progress_at=10.0,
        ...                 typical_gap=0.5)
        >>> w.silent_for(now=25.0), w.silent_for(now=45.0)
        (None, 35.0)
        """
        since = self.last_progress_at if self.last_progress_at is not None else self.ready_at
        if self.status != WorkerStatus.RUNNING or since is None:
            return None
        quiet = now - since
        return quiet if quiet > max(SILENCE_FLOOR, SILENCE_FACTOR * (self.typical_gap or 0.0)) else None

    @property
    def epoch_text(self) -> str:
        """``epoch 3/8`` (the third of eight, counted from 1) inside ``ctx.epochs(8)``; else the
        epoch as reported: ``epoch 2``."""
        return "" if self.epoch is None else f"epoch {epoch_label(self.epoch, self.epochs)}"

    def eta(self) -> Optional[float]:
        """Seconds this running rank still needs to reach ``total`` at its current rate.

        >>> w = WorkerState(0, "cpu:0", status=WorkerStatus.RUNNING, step=40, total=100, rate=20.0)
        >>> w.eta()
        3.0
        """
        if self.status != WorkerStatus.RUNNING or not self.total or self.step is None or not self.rate:
            return None
        return max(0.0, (self.total - self.step) / self.rate)

    def _measure_rate(self, t: float, step: int) -> None:
        if self._rate_anchor is None or step < self._rate_anchor[1]:  # first report, or steps started over
            self._rate_anchor = (t, step)
            return
        t0, step0 = self._rate_anchor
        if t - t0 >= RATE_WINDOW:
            now_rate = (step - step0) / (t - t0)
            self.rate = now_rate if self.rate is None else 0.6 * self.rate + 0.4 * now_rate
            self._rate_anchor = (t, step)

    def stderr_tail(self, n: int = 30) -> list[str]:
        return [text for stream, text in self.output if stream == "stderr"][-n:]


@dataclass
class DataState:
    """The call's large tensors and arrays on their way to the ranks (``transfer.packing``): bytes
    copied into shared memory so far, of ``total``; files mapped from themselves; ``seconds`` once done."""

    total: int = 0
    sent: int = 0
    files: list[str] = field(default_factory=list)
    seconds: Optional[float] = None  # None: still being sent
    in_place: int = 0  # bytes already in shared memory (ddp_notebook.share, a run's result): not copied

    @property
    def sending(self) -> bool:
        return self.seconds is None


@dataclass
class RequestState:
    """A session's request running now (``RunState.request``): ``what`` (``cell 3``, ``push lr``,
    ``pull 'x'``), on ``ranks``, since ``started``; ``first_line`` of the cell's code;
    ``background``: run without blocking; ``interrupting``: its ranks were asked to leave it;
    ``answered``: rank → (done, error or interrupted, when); ``code``: the cell's code."""

    what: str
    ranks: list[int]
    started: float
    cell: Optional[int] = None
    first_line: str = ""
    background: bool = False
    interrupting: bool = False
    answered: dict[int, tuple[str, float]] = field(default_factory=dict)
    code: str = ""


@dataclass
class CellRecord:
    """A session's cell (or push, pull: ``cell`` None), as its run's log keeps it: what ran
    where, how it ended, and for a cell that failed, each failed rank's failure (traceback, the
    failed frame's variables)."""

    cell: Optional[int]
    ranks: list[int]
    status: str  # ok, failed, interrupted or ended (the session ended in it)
    code: str
    time: float  # when it ended
    seconds: float
    message: str = ""  # what it raised, as the notebook said it
    failures: list[WorkerFailure] = field(default_factory=list)
    what: str = ""  # cell 3, push lr, pull 'x'
    values: list[str] = field(default_factory=list)  # each rank's value, in words ([rank 0] 1)

    def first_line(self, limit: int = 50) -> str:
        """The cell's first line of code, cut at ``limit`` characters: how lists name the cell.

        >>> code = "\\nw = torch.zeros(8 + rank, 4)  # one row too many"
        >>> CellRecord(3, [0, 1], "failed", code, 0.0, 0.1).first_line(20)
        'w = torch.zeros(8 +…'
        """
        first = next((line.strip() for line in self.code.splitlines() if line.strip()), "")
        return first if len(first) <= limit else first[:limit - 1] + "…"

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> CellRecord:
        """The record a ``cell`` event holds (a log of another version: what can be read)."""
        failures = []
        for data in event.get("failures") or []:
            try:
                failures.append(WorkerFailure.from_dict(data))
            except (TypeError, ValueError):
                pass  # not a failure this version can read: the message still says it
        cell = event.get("cell")
        cell = cell if isinstance(cell, int) else None
        return cls(cell=cell, ranks=[r for r in event.get("ranks") or [] if isinstance(r, int)],
                   status=str(event.get("status") or ""), code=str(event.get("code") or ""),
                   time=float(event.get("time") or 0.0), seconds=float(event.get("seconds") or 0.0),
                   message=str(event.get("message") or ""), failures=failures,
                   what=str(event.get("what") or (f"cell {cell}" if cell is not None else "")),
                   values=[cut(str(v), LINE_CHARS) for v in event.get("values") or []][:CELL_VALUES_KEPT])


@dataclass
class RunState:
    """A run's status, its workers, its failures, folded from events in order."""

    run_id: str = ""
    devices: list[str] = field(default_factory=list)
    backend: Optional[str] = None
    run_dir: Optional[str] = None
    status: RunStatus = RunStatus.STARTING
    started_at: Optional[float] = None
    ended_at: Optional[float] = None
    stop_reason: Optional[str] = None
    notebook_ended: bool = False  # ended because its notebook process did (restart, crash): stop_reason says when
    supervisor_error: Optional[str] = None  # ddp_notebook's own supervision failed: what happened
    parent: Optional[str] = None  # the run this one retries
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    workers: dict[int, WorkerState] = field(default_factory=dict)
    failures: list[WorkerFailure] = field(default_factory=list)
    log_truncated: bool = False  # the log on disk reached its limit: later progress and output are not in it
    data: Optional[DataState] = None  # the call's shared tensors and arrays, when it has some
    result_not_kept: Optional[int] = None  # bytes of a result too large to be kept on disk
    waiting: Optional[str] = None  # what the ranks wait for before they can start (the fork server's import)
    # What the run was (core.experiment): given at its start.
    name: Optional[str] = None
    tags: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    origin: str = "launch"  # what started it: launch, fit, spawn or session
    cwd: Optional[str] = None  # the notebook's working directory at the launch
    monitor: Optional[str] = None  # the value whose best the run records (fit's monitor, launch's monitor=)
    monitor_mode: str = "min"  # whether a lower or a higher monitored value is better
    code: Optional[str] = None  # a fingerprint of the function's code (core.experiment.code_fingerprint)
    # What reproduces it: python and ddp_notebook (at the start), torch (rank 0's ready report),
    # git_commit and git_dirty (looked up after the start).
    versions: dict[str, Any] = field(default_factory=dict)
    report_to: list[str] = field(default_factory=list)  # the trackers it reports to, by name
    # Every number rank 0 logged, by name: (step, value) points, the step being the rank's step
    # at that log (its count of logs when it never said one); thinned past SERIES_KEPT.
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    series_epochs: dict[str, list[Optional[int]]] = field(default_factory=dict)  # each point's epoch
    unstepped: set[str] = field(default_factory=set)  # series with a point logged before any step
    points_seen: int = 0
    best: Optional[dict[str, Any]] = None  # the monitored value's best: {"value", "step", "epoch"}
    tracker_notes: list[str] = field(default_factory=list)  # a tracker that is missing, failed or fell behind
    cells: int = 0  # a session's cells run
    cell_records: list[CellRecord] = field(default_factory=list)  # the latest CELLS_KEPT of them
    request: Optional[RequestState] = None  # a session's request running now
    last_request: Optional[CellRecord] = None  # how a session's last request (cell, push, pull) ended
    pruned: bool = False  # stopped by an Optuna trial's pruner

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def session_activity(self, rank: int) -> Optional[str]:
        """What a session's rank does, as its row says it instead of its run's status while the
        session lives (None for a run that is no session's, or has ended but by a close):
        ``idle``, ``in cell 3`` (or ``in push lr``), ``finished cell 3`` (it waits for the
        others), ``failed in cell 3`` (in the request in flight, or the last one while nothing
        runs), ``interrupted in cell 3`` (it left the cell when asked); ``closed`` once the
        session was closed.

        >>> s = RunState()
        >>> s.apply({"kind": "run_started", "time": 0.0, "devices": ["cpu:0", "cpu:1"], "origin": "session"})
        >>> s.apply({"kind": "request", "time": 1.0, "what": "cell 3", "cell": 3, "ranks": [0]})
        >>> s.session_activity(0), s.session_activity(1)
        ('in cell 3', 'idle')
        """
        if self.origin != "session":
            return None
        if self.finished:
            return "closed" if self.status == RunStatus.SUCCEEDED else None
        request, last = self.request, self.last_request
        if request is None or rank not in request.ranks:
            failed = request is None and last is not None and last.status == "failed" and \
                any(f.rank == rank for f in last.failures)
            return f"failed in {last.what}" if failed and last is not None else "idle"
        how = request.answered.get(rank, ("", 0.0))[0]
        return {"done": f"finished {request.what}", "": f"in {request.what}",
                "interrupted": f"interrupted in {request.what}"}.get(how, f"failed in {request.what}")

    @property
    def session_status(self) -> str:
        """A session's run in a session's words: ``forming`` (its ranks start), ``ready``,
        ``running`` (a request is in flight), ``ended`` (a rank failed, a stall was named, it was
        stopped: ``session.restart()`` forms it again) or ``closed`` (``session.close()``).

        >>> RunState(status=RunStatus.RUNNING).session_status, RunState(status=RunStatus.SUCCEEDED).session_status
        ('ready', 'closed')
        """
        if self.status == RunStatus.STARTING:
            return "forming"
        if self.status == RunStatus.RUNNING:
            return "running" if self.request is not None else "ready"
        return "closed" if self.status == RunStatus.SUCCEEDED else "ended"

    @property
    def failed_cell(self) -> Optional[CellRecord]:
        """A session's last cell that failed with the ranks' errors (None: none did)."""
        return next((c for c in reversed(self.cell_records) if c.status == "failed" and c.failures), None)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def waiting_for(self) -> Optional[str]:
        """What the ranks wait for before any can start, while they do (``importing torch once for
        this notebook``); None once one has started, or when they did not wait.

        >>> s = RunState(status=RunStatus.STARTING, waiting="importing torch", workers={0: WorkerState(0, "cpu:0")})
        >>> s.waiting_for
        'importing torch'
        """
        if self.waiting is None or self.status != RunStatus.STARTING:
            return None
        return None if any(w.pid is not None or w.finished for w in self.workers.values()) else self.waiting

    @property
    def quiet_note(self) -> Optional[str]:
        """While no rank makes progress: which rank holds the others up, in one line
        (``rank 0 waits in all_reduce (train.py:9) for rank 1; rank 1 runs at train.py:12, 100 % CPU``);
        None while the run progresses.

        >>> s = RunState(workers={0: WorkerState(0, "cpu:0", note="waits in barrier (t.py:3) for rank 1"),
        ...                       1: WorkerState(1, "cpu:1", note="runs at t.py:7, 99 % CPU")})
        >>> s.quiet_note
        'rank 0 waits in barrier (t.py:3) for rank 1; rank 1 runs at t.py:7, 99 % CPU'
        """
        notes = [f"rank {r} {w.note}" for r, w in sorted(self.workers.items()) if w.note]
        return "; ".join(notes) if notes else None

    @property
    def root_failure(self) -> Optional[WorkerFailure]:
        causes = [f for f in self.failures if not f.consequence]
        return causes[0] if causes else (self.failures[0] if self.failures else None)

    @property
    def causing_ranks(self) -> set[int]:
        """Ranks whose failure was a cause, not a consequence of another's."""
        return {f.rank for f in self.failures if not f.consequence}

    @property
    def healthy_devices(self) -> list[str]:
        """The devices, in rank order, whose workers did not cause a failure."""
        causing = self.causing_ranks
        return [d for rank, d in enumerate(self.devices) if rank not in causing]

    @property
    def history(self) -> list[dict[str, Any]]:
        """Rank 0's epochs as rows (``epoch_row``), the panel's epoch table but an epoch a stop cut
        short (``ctx.batches`` left it early): ``Run.history``."""
        main = self.workers.get(0)
        return [epoch_row(r) for r in main.epoch_history if not r.get("cut")] if main is not None else []

    @property
    def metrics(self) -> dict[str, Any]:
        """The last value of every metric rank 0 logged; the best of the monitored one, as
        ``valid_loss.min`` (or ``.max``); each rank's peak memory, as ``rank1.peak_rss`` (and
        ``rank1.peak_cuda`` on a GPU), in bytes: ``Run.metrics``."""
        main = self.workers.get(0)
        out: dict[str, Any] = dict(main.metrics) if main is not None else {}
        if self.best is not None and self.monitor:
            out[f"{self.monitor}.{self.monitor_mode}"] = self.best["value"]
        for rank, w in sorted(self.workers.items()):
            if w.peak_rss is not None:
                out[f"rank{rank}.peak_rss"] = w.peak_rss
            if w.peak_cuda is not None:
                out[f"rank{rank}.peak_cuda"] = w.peak_cuda
        return out

    @property
    def headline_metric(self) -> Optional[tuple[str, Any]]:
        """The one value a list of runs shows: the monitored one's best, else the last
        ``valid_loss``, else the last ``loss``; None when rank 0 logged none of them."""
        if self.best is not None and self.monitor:
            return f"{self.monitor} ({self.monitor_mode})", self.best["value"]
        main = self.workers.get(0)
        logged = main.metrics if main is not None else {}
        for name in (self.monitor, *VALID_LOSS, "train_loss", "loss"):
            if name and name in logged:
                return name, logged[name]
        return None

    def apply(self, event: dict[str, Any]) -> None:
        """Fold one event into the state."""
        kind = event["kind"]
        t = event.get("time")
        if kind == EventKind.RUN_STARTED:
            self.run_id = event.get("run_id", "")
            self.devices = list(event.get("devices", []))
            self.backend = event.get("backend")
            self.run_dir = event.get("run_dir")
            self.parent = event.get("parent")
            self.waiting = event.get("waiting")
            self.started_at = t
            places = event.get("places") or [None] * len(self.devices)
            hosts = event.get("hosts") or [None] * len(self.devices)
            self.workers = {r: WorkerState(r, d, p, h) for r, (d, p, h) in enumerate(zip(self.devices, places, hosts))}
            self.name = event.get("name")
            self.tags = dict(event.get("tags") or {})
            self.config = dict(event.get("config") or {})
            self.origin = str(event.get("origin") or "launch")
            self.cwd = event.get("cwd")
            self.monitor = event.get("monitor")
            self.monitor_mode = "max" if event.get("monitor_mode") == "max" else "min"
            self.code = event.get("code")
            self.versions = dict(event.get("versions") or {})
            self.report_to = [str(t) for t in event.get("report_to") or []]
        elif kind == EventKind.PROVENANCE:
            self.versions.update({k: v for k, v in event.items() if k not in ("kind", "time")})
        elif kind == EventKind.TRACKER:
            if len(self.tracker_notes) < TRACKER_NOTES_KEPT:
                self.tracker_notes.append(cut(str(event.get("message", "")), LINE_CHARS))
        elif kind == EventKind.REQUEST:
            cell = event.get("cell")
            self.request = RequestState(str(event.get("what") or ""), [r for r in event.get("ranks") or []
                                                                       if isinstance(r, int)],
                                        float(t or 0.0), cell if isinstance(cell, int) else None,
                                        cut(str(event.get("first_line") or ""), LINE_CHARS),
                                        bool(event.get("background")), code=str(event.get("code") or ""))
        elif kind == EventKind.ANSWERED:
            if self.request is not None and event.get("rank") in self.request.ranks:
                self.request.answered[event["rank"]] = (str(event.get("status") or ""), float(t or 0.0))
        elif kind == EventKind.INTERRUPTING:
            if self.request is not None:
                self.request.interrupting = True
        elif kind == EventKind.CELL:
            self.request = None
            self.last_request = record = CellRecord.from_event(event)
            if record.cell is not None and self.cell_records and self.cell_records[-1].cell == record.cell:
                self.cell_records[-1] = record  # told again, later (a cell the notebook's end cut, then its session)
            elif record.cell is not None:
                self.cells += 1
                self.cell_records.append(record)
                del self.cell_records[:-CELLS_KEPT]
        elif kind == EventKind.RUN_FINISHED:
            self.request = None  # whatever ran has ended with the ranks (the session may add how, later)
            for worker in self.workers.values():
                worker.note = None
            self.status = RunStatus(event["status"])
            self.ended_at = t
            self.result_not_kept = event.get("result_not_kept")
            # The run's record at its end (a list of runs reads no progress): rank 0's last values
            # and the monitored value's best.
            if isinstance(event.get("metrics"), dict) and 0 in self.workers:
                self.workers[0].metrics = dict(event["metrics"])
            if isinstance(event.get("best"), dict):
                self.best = dict(event["best"])
        elif kind == EventKind.STOPPING:
            self.stop_reason = event.get("reason")
            self.notebook_ended = bool(event.get("notebook_ended"))
            self.pruned = bool(event.get("pruned"))
        elif kind == EventKind.SUPERVISOR_ERROR:
            self.supervisor_error = event.get("message")
        elif kind == EventKind.QUIET:
            notes = event.get("notes")
            notes = notes if isinstance(notes, dict) else {}
            for r, worker in self.workers.items():
                note = notes.get(str(r))
                worker.note = cut(str(note), LINE_CHARS) if note and not worker.finished else None
        elif kind == EventKind.LOG_TRUNCATED:
            self.log_truncated = True
        elif kind == EventKind.DATA:
            self.data = DataState(int(event.get("total") or 0), int(event.get("sent") or 0),
                                  [str(f) for f in event.get("files") or []], event.get("seconds"),
                                  int(event.get("in_place") or 0))
        elif kind == EventKind.FAILURE:
            failure = WorkerFailure.from_dict(event["failure"])
            # Recorded again under its id (a cause found to be a consequence): the new record wins.
            # (A log written before failures had ids says the same by rank, kind and time.)
            same = [i for i, f in enumerate(self.failures)
                    if (f.id, f.rank, f.kind) == (failure.id, failure.rank, failure.kind)
                    and (failure.id or f.time == failure.time)]
            if same:
                self.failures[same[0]] = failure
            else:
                self.failures.append(failure)
            w = self.workers.get(event["failure"]["rank"])
            if w is not None:
                w.status = WorkerStatus.FAILED
                w.note = None
                w.knock_on = failure.consequence
        else:
            rank = event.get("rank")
            w = self.workers.get(rank) if rank is not None else None
            if w is not None:
                self._apply_to_worker(w, kind, event, t)

    @staticmethod
    def _apply_losses(w: WorkerState, event: dict[str, Any]) -> None:
        """A report's loss points (its bins, or its own loss from a rank that does not bin) and
        epoch records, for the plot and the epoch table."""
        bins = event.get("loss_bins")
        if isinstance(bins, list):
            w.loss_binned = True
            points = [(float(x), float(y)) for x, y in bins]
            opened = event.get("loss_open")
            w.loss_open = None
            if isinstance(opened, list) and len(opened) == 2:
                w.loss_open = (float(opened[0]), float(opened[1]))
        else:
            loss = (event.get("metrics") or {}).get("loss")
            points = []
            if isinstance(loss, (int, float)) and not isinstance(loss, bool) and abs(loss) < 1e308:
                if not w.loss_binned:
                    step = event.get("step")
                    points = [(float(step if step is not None else len(w.loss_history) + 1), float(loss))]
        w.loss_history.extend(points)
        if len(w.loss_history) > LOSS_POINTS_KEPT:
            w.loss_history = w.loss_history[::2]
        for record in event.get("epoch_records") or []:
            if w.epoch_history and w.epoch_history[-1].get("epoch") == record.get("epoch"):
                w.epoch_history[-1] = record  # the open epoch, updated
            else:
                w.epoch_history.append(record)
                if len(w.epoch_history) > EPOCHS_KEPT:
                    del w.epoch_history[EPOCHS_KEPT // 2]  # the first and the latest ones stay

    def _apply_points(self, points: list[Any]) -> None:
        """Rank 0's logged values (``[time, step, epoch, {name: value}]`` each, in order): its series
        and the best of the monitored one. (A report may carry a thousand: the loop is kept lean.)"""
        series, epochs, monitor = self.series, self.series_epochs, self.monitor
        lower = self.monitor_mode == "min"
        isfinite = math.isfinite
        for point in points:
            if type(point) is not list or len(point) != 4 or type(point[3]) is not dict:
                continue
            self.points_seen += 1
            _t, step, epoch, values = point
            stepped = type(step) in (int, float)
            x = float(step) if stepped else float(self.points_seen)
            if type(epoch) is not int:
                epoch = None
            for name, value in values.items():
                if type(value) not in (int, float) or not isfinite(value):
                    continue
                kept = series.get(name)
                if kept is None:
                    if len(series) >= METRICS_KEPT:
                        continue  # a new name each step must not grow it
                    kept = series[name] = []
                    epochs[name] = []
                kept.append((x, float(value)))
                epochs[name].append(epoch)
                if not stepped:
                    self.unstepped.add(name)
                if len(kept) > SERIES_KEPT:
                    series[name] = kept[::2]
                    epochs[name] = epochs[name][::2]
                if name == monitor:
                    best = self.best
                    if best is None or (value < best["value"] if lower else value > best["value"]):
                        self.best = {"value": value, "step": step, "epoch": epoch}

    def _apply_to_worker(self, w: WorkerState, kind: str, event: dict[str, Any], t: Optional[float]) -> None:
        memory = event.get("memory")  # (progress reports, and a rank's outcome)
        if isinstance(memory, dict):
            for key, attr in (("rss", "peak_rss"), ("cuda", "peak_cuda")):
                if isinstance(memory.get(key), int):
                    setattr(w, attr, max(memory[key], getattr(w, attr) or 0))
        if kind == EventKind.STARTED:
            w.pid = event.get("pid")
            w.started_at = t
        elif kind == EventKind.READY:
            w.status = WorkerStatus.RUNNING
            w.ready_at = t
            if w.rank == 0 and event.get("torch"):
                self.versions["torch"] = event["torch"]
            if self.status == RunStatus.STARTING:
                self.status = RunStatus.RUNNING
        elif kind == EventKind.PROGRESS:
            if not event.get("held"):  # progress again: the run is not quiet (a held report is old news)
                for other in self.workers.values():
                    other.note = None
            for key in ("step", "total", "epoch", "epochs"):
                if event.get(key) is not None:
                    setattr(w, key, event[key])
            for name, value in (event.get("metrics") or {}).items():
                if name in w.metrics or len(w.metrics) < METRICS_KEPT:  # a new name each step must not grow it
                    w.metrics[name] = float(value) if value in NOT_FINITE else value  # (JSON has no nan)
            if t is not None and w.last_progress_at is not None:
                gap = max(0.0, t - w.last_progress_at)
                w.typical_gap = gap if w.typical_gap is None else 0.8 * w.typical_gap + 0.2 * gap
            w.last_progress_at = t
            if t is not None and isinstance(event.get("step"), int):
                w._measure_rate(t, event["step"])
            self._apply_losses(w, event)
            if w.rank == 0 and isinstance(event.get("points"), list):
                self._apply_points(event["points"])
        elif kind == EventKind.CHECKPOINT:
            self.checkpoints.append({"epoch": event.get("epoch"), "path": event.get("path")})
        elif kind == EventKind.OUTPUT:
            for stream, line, replaces in w.console.feed(event["stream"], event["text"]):
                if replaces and w.output and w.output[-1][0] == stream:
                    w.output.pop()  # a progress bar redrawn: its line, once
                else:
                    w.output_lines += 1
                w.output.append((stream, cut(line, LINE_CHARS)))
        elif kind == EventKind.DONE:
            w.returned = True
            w.note = None
            # Returning after a stop was asked is leaving because of it: a stopped rank is "stopped".
            w.status = WorkerStatus.STOPPED if self.stop_reason is not None else WorkerStatus.SUCCEEDED
        elif kind == EventKind.EXITED:
            w.pid = w.pid or event.get("pid")  # a worker ended before it said it started
            w.note = None
            w.exit_code = event.get("exit_code")
            w.ended_at = t
            if not w.finished:
                w.status = WorkerStatus.STOPPED if event.get("by_supervisor") else WorkerStatus.FAILED
