"""Every step's loss reaches the plot, binned on the rank, and every epoch its record: the rank's
``LossHistory`` and the run state that folds what it sends."""
import pytest

from ddp_notebook.core.state import LOSS_POINTS_KEPT, RunState
from ddp_notebook.worker.loss_history import BINS_PER_WIDTH, LossHistory

pytestmark = pytest.mark.unit

START = {"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0"], "backend": "gloo"}


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_a_fast_run_sends_every_step_until_the_bins_widen():
    h = LossHistory()
    sent = []
    for step in range(1, 101):
        h.add(step, None, {"loss": 1.0 / step})
        if step % 37 == 0:  # reports are sent now and then: the bins ride on them
            sent += h.attach({"kind": "progress"})["loss_bins"]
    h.close()
    sent += h.attach({"kind": "progress"})["loss_bins"]
    assert [x for x, _ in sent] == [float(s) for s in range(1, 101)]
    assert sent[9] == [10.0, 0.1]


def test_a_long_run_sends_a_bounded_number_of_points_and_their_means():
    h = LossHistory()
    steps = 100 * BINS_PER_WIDTH
    for step in range(1, steps + 1):
        h.add(step, None, {"loss": float(step % 2)})  # a zigzag of 0 and 1: a bin of 2 or more means 0.5
    h.close()
    points = h.attach({"kind": "progress"})["loss_bins"]
    assert len(points) < BINS_PER_WIDTH * 8  # log2(100) doublings of BINS_PER_WIDTH bins each
    assert [x for x, _ in points] == sorted(x for x, _ in points) and points[-1][0] > steps - h.width
    assert all(y == 0.5 for _, y in points[BINS_PER_WIDTH:])


def test_a_loss_logged_without_a_step_is_counted_and_nan_is_skipped():
    h = LossHistory()
    for loss in (3.0, float("nan"), 1.0):
        h.add(None, None, {"loss": loss})
    h.close()
    assert h.attach({"kind": "progress"})["loss_bins"] == [[1.0, 3.0], [3.0, 1.0]]


def test_epoch_records_hold_the_mean_loss_the_last_metrics_and_the_time():
    clock = Clock()
    h = LossHistory(clock=clock)
    for epoch in range(2):
        for i in range(4):
            clock.now += 1.0
            h.add(epoch * 4 + i + 1, epoch, {"loss": float(i), "samples_per_s": 10.0 * i})
        clock.now += 0.5
        h.add(None, epoch, {"train_loss": 1.5, "valid_loss": 2.0 - epoch, "acc": "n/a"})
        if epoch == 0:
            first = h.attach({"kind": "progress"})["epoch_records"]
    assert first == [{"epoch": 0, "seconds": 4.5, "loss_mean": 1.5, "losses": 4,
                      "metrics": {"samples_per_s": 30.0, "train_loss": 1.5, "valid_loss": 2.0}}]
    h.close()
    last = h.attach({"kind": "progress"})["epoch_records"]
    assert [r["epoch"] for r in last] == [1] and last[0]["seconds"] == 4.5 and last[0]["metrics"]["valid_loss"] == 1.0
    assert "epoch_records" not in h.attach({"kind": "progress"})  # nothing changed since


def test_the_state_plots_the_bins_not_the_reports_loss_and_keeps_one_record_per_epoch():
    s = RunState()
    s.apply(START)
    s.apply({"kind": "progress", "time": 1.0, "rank": 0, "step": 3, "metrics": {"loss": 9.0},
             "loss_bins": [[1.0, 3.0], [2.0, 2.0]], "epoch_records": [{"epoch": 0, "seconds": 1.0, "metrics": {}}]})
    s.apply({"kind": "progress", "time": 2.0, "rank": 0, "step": 5, "metrics": {"loss": 8.0}})
    s.apply({"kind": "progress", "time": 3.0, "rank": 0, "metrics": {}, "loss_bins": [[3.0, 1.0]],
             "epoch_records": [{"epoch": 0, "seconds": 2.0, "metrics": {"valid_loss": 0.5}},
                               {"epoch": 1, "seconds": 0.1, "metrics": {}}]})
    w = s.workers[0]
    assert w.loss_history == [(1.0, 3.0), (2.0, 2.0), (3.0, 1.0)]  # 9.0 and 8.0 are a bin's, not points
    assert [(r["epoch"], r["seconds"]) for r in w.epoch_history] == [(0, 2.0), (1, 0.1)]
    old = RunState()  # a log written before ranks binned: each report's loss is a point
    old.apply(START)
    for step in range(1, LOSS_POINTS_KEPT + 2):
        old.apply({"kind": "progress", "time": 1.0, "rank": 0, "step": step, "metrics": {"loss": 1.0}})
    assert 0 < len(old.workers[0].loss_history) <= LOSS_POINTS_KEPT


def test_the_bin_still_filling_is_drawn_after_the_closed_ones_until_a_report_closes_it():
    h = LossHistory(clock=Clock())
    for step in range(1, 4):
        h.add(step, None, {"loss": float(step)})
    first = h.attach({"kind": "progress", "time": 1.0, "rank": 0, "step": 3, "metrics": {}})
    assert first["loss_bins"] == [[1.0, 1.0], [2.0, 2.0]] and first["loss_open"] == [3.0, 3.0]
    s = RunState()
    s.apply(START)
    s.apply(first)
    # A rank quiet after step 3: the plot already ends at step 3, not at step 2.
    assert s.workers[0].loss_points == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0)]
    h.add(4, None, {"loss": 4.0})
    s.apply(h.attach({"kind": "progress", "time": 2.0, "rank": 0, "step": 4, "metrics": {}}))
    assert s.workers[0].loss_points == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0), (4.0, 4.0)]  # 3 closed, 4 open
    h.close()
    s.apply(h.attach({"kind": "progress", "time": 3.0, "rank": 0, "step": 4, "metrics": {}}))
    assert s.workers[0].loss_history == [(1.0, 1.0), (2.0, 2.0), (3.0, 3.0), (4.0, 4.0)]
    assert s.workers[0].loss_open is None
