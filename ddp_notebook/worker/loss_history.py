"""What a rank keeps of what it logs between two reports, so the notebook sees every step.

Progress reports are throttled (one every ``progress_interval``), so a loss curve drawn from them
is a sample: a fast run's is a zigzag of a few points. ``LossHistory`` sees every ``ctx.log``
instead, throttled or not, and keeps

- the loss of every step in bins of ``width`` consecutive steps (their mean), the width doubling
  each time ``BINS_PER_WIDTH`` bins of one width were closed: a run of ``n`` steps sends about
  ``BINS_PER_WIDTH * log2(n / BINS_PER_WIDTH)`` points in all, never one per step of a long run;
- one record per epoch: the mean of the step losses logged in it, the last value of every other
  number logged in it (``train_loss``, ``valid_loss``, ``acc``...), and its length in seconds;
- on rank 0 (``record_points``), every number of every ``ctx.log`` with its time, step and epoch:
  the run's record (its series, the best monitored value) and what its trackers and trial get
  are made of these, never of the throttled reports' samples. At most ``POINTS_PER_REPORT`` wait
  for a report: then one is sent at once (``full``), so the rank's memory stays bounded.

The next report that is sent carries what was closed or changed since the previous one
(``loss_bins``: ``[step, mean loss]`` pairs; ``loss_open``: the bin still filling, so far;
``epoch_records``; ``points``: ``[time, step, epoch, {name: number}]`` each), and the state in the notebook
(``core.state``) adds them to the rank's loss plot and epoch table.

>>> h = LossHistory(clock=iter(range(100)).__next__)
>>> for step in range(1, 4):
...     h.add(step, 0, {"loss": float(step)})
>>> h.add(None, 0, {"valid_loss": 0.5})
>>> h.close()
>>> event = h.attach({"kind": "progress"})
>>> event["loss_bins"]
[[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]
>>> event["epoch_records"]
[{'epoch': 0, 'seconds': 4.0, 'metrics': {'valid_loss': 0.5}, 'loss_mean': 2.0, 'losses': 3}]
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from ..core.events import NOT_FINITE

__all__ = ["LossHistory", "BINS_PER_WIDTH", "POINTS_PER_REPORT"]

BINS_PER_WIDTH = 200
"""Bins closed at one width before the width doubles."""
EPOCH_METRICS_KEPT = 50
"""Numbers kept per epoch record besides the loss (the first ones logged in the epoch)."""
POINTS_PER_REPORT = 1000
"""Logged values (``ctx.log`` calls) that wait for a report at most: then a report goes at once."""


_NUMBERS = (int, float)  # (exactly: a bool is no number here)


def _seconds(record: dict[str, Any]) -> float:
    """An epoch record's length: from the previous epoch's last report to its own last."""
    return round(float(record["end"] - record["start"]), 3)


def _number(value: Any) -> Optional[float]:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class LossHistory:
    """The step losses and epoch records of one rank, until a report carries them.

    Parameters
    ----------
    clock : callable, optional
        Seconds now (``time.time``); a test gives its own.
    record_points : bool, default False
        Keep every number of every log for the next report (rank 0 does).
    """

    def __init__(self, clock: Callable[[], float] = time.time, record_points: bool = False) -> None:
        self._clock = clock
        self._record_points = record_points
        self._points: list[list[Any]] = []  # [time, step, epoch, {name: number}], not yet sent
        self._last_step: Optional[int] = None  # the step a log without one is taken at
        self.width = 1
        self._closed_at_width = 0
        self._bin: Optional[list[float]] = None  # [index, step sum, loss sum, count]
        self._bins: list[list[float]] = []  # closed, not yet sent
        self._calls = 0  # the x of a loss logged without a step
        self.seen_loss = False
        self._epoch_end = clock()  # when the previous epoch's last report came: the next one's start
        self._records: dict[int, dict[str, Any]] = {}  # the open epoch, and closed ones not yet sent
        self._changed: set[int] = set()
        self._open: Optional[int] = None
        self._lock = threading.Lock()  # ctx.log may be called from several threads

    # ---- what the rank logs ---------------------------------------------------------------
    def add(self, step: Optional[int], epoch: Optional[int], metrics: dict[str, Any]) -> None:
        """Take one ``ctx.log`` (before throttling): its step, epoch and metrics (JSON values)."""
        with self._lock:
            self._add(step, epoch, metrics)

    def _add(self, step: Optional[int], epoch: Optional[int], metrics: dict[str, Any]) -> None:
        self._calls += 1
        now = self._clock()
        if step is not None:
            self._last_step = step
        if self._record_points:
            # Numbers (JSON values already: a float is finite), a non-finite one as its text (a
            # divergence is a value a tracker must show). On every log: kept lean.
            numbers = {k: v for k, v in metrics.items() if type(v) in _NUMBERS or v in NOT_FINITE}
            if numbers:
                self._points.append([now, self._last_step, epoch, numbers])
        loss = _number(metrics.get("loss"))
        if loss is not None:
            self.seen_loss = True
            self._add_loss(float(step) if step is not None else float(self._calls), loss)
        if epoch is None:
            return
        if self._open is not None and epoch != self._open:
            self._close_epoch()
        record = self._records.get(epoch)
        if record is None:
            record = self._records[epoch] = {"epoch": epoch, "start": self._epoch_end, "metrics": {},
                                             "loss_sum": 0.0, "losses": 0}
        self._open = epoch
        for name, value in metrics.items():
            number = _number(value)
            if name != "loss" and number is not None and (name in record["metrics"]
                                                          or len(record["metrics"]) < EPOCH_METRICS_KEPT):
                record["metrics"][name] = number
        if loss is not None:
            record["loss_sum"] += loss
            record["losses"] += 1
        record["end"] = now
        self._changed.add(epoch)

    def _add_loss(self, x: float, loss: float) -> None:
        index = int((x - 1) // self.width)
        if self._bin is not None and index != self._bin[0]:
            self._close_bin()
            index = int((x - 1) // self.width)  # the width may have doubled
        if self._bin is None:
            self._bin = [index, 0.0, 0.0, 0]
        self._bin[1] += x
        self._bin[2] += loss
        self._bin[3] += 1

    def _close_bin(self) -> None:
        if self._bin is None:
            return
        _index, xs, losses, n = self._bin
        self._bins.append([xs / n, losses / n])
        self._bin = None
        self._closed_at_width += 1
        if self._closed_at_width >= BINS_PER_WIDTH:
            self.width *= 2
            self._closed_at_width = 0

    def _close_epoch(self) -> None:
        if self._open is not None and self._open in self._records:
            self._epoch_end = self._records[self._open].get("end", self._epoch_end)
        self._open = None

    def cut(self, epoch: Optional[int]) -> None:
        """A stop cut ``epoch`` short (``ctx.batches`` left it early): its record says so, and is
        no epoch of the run's history."""
        with self._lock:
            record = self._records.get(epoch) if epoch is not None else None
            if epoch is not None and record is not None:
                record["cut"] = True
                self._changed.add(epoch)

    def close(self) -> None:
        """The function ended: its last bin and its last epoch are complete."""
        with self._lock:
            self._close_bin()
            self._close_epoch()

    # ---- what a report carries ------------------------------------------------------------
    @property
    def unsent(self) -> bool:
        """Whether closed bins, changed epoch records or logged values wait for a report."""
        return bool(self._bins or self._changed or self._points)

    @property
    def full(self) -> bool:
        """Whether as many logged values wait as a report may carry: one must go now."""
        return len(self._points) >= POINTS_PER_REPORT

    def attach(self, event: dict[str, Any]) -> dict[str, Any]:
        """``event`` with what was closed or changed since the last report (a new dict; the
        event itself when nothing was)."""
        with self._lock:
            return self._attach(event)

    def _attach(self, event: dict[str, Any]) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if self.seen_loss:  # even empty: the notebook then plots bins only, never a report's loss
            extra["loss_bins"], self._bins = self._bins, []
            if self._bin is not None:  # the bin still filling, as it is now (the next report replaces it)
                _index, xs, losses, n = self._bin
                extra["loss_open"] = [xs / n, losses / n]
        if self._points:
            extra["points"], self._points = self._points, []
        if self._changed:
            extra["epoch_records"] = [self._record(self._records[e]) for e in sorted(self._changed)]
            self._changed = set()
            self._records = {e: r for e, r in self._records.items() if e == self._open}
        return dict(event, **extra) if extra else event

    def seconds_of(self, epoch: int) -> Optional[float]:
        """How long ``epoch`` took, as its record says it (from the previous epoch's last report
        to its own last), while it is the open epoch; None once it is not."""
        with self._lock:
            record = self._records.get(epoch)
            return _seconds(record) if record and "end" in record else None

    @staticmethod
    def _record(record: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"epoch": record["epoch"], "seconds": _seconds(record),
                               "metrics": dict(record["metrics"])}
        if record["losses"]:
            out["loss_mean"] = record["loss_sum"] / record["losses"]
            out["losses"] = record["losses"]
        if record.get("cut"):
            out["cut"] = True
        return out
