"""What a run was, as plain data (core.experiment), and its record folded from events
(core.state): names and tags checked, configs summarized, code fingerprinted, differences found;
rank 0's every value, its best, each rank's peak memory, the epochs as rows."""
import functools
import math
import time

import numpy as np
import pytest
import torch

from ddp_notebook.core.experiment import (
    call_config,
    check_name,
    check_tags,
    code_fingerprint,
    describe_callable,
    differing,
    summarize,
)
from ddp_notebook.core.state import SERIES_KEPT, RunState
from ddp_notebook.errors import LaunchOptionError
from ddp_notebook.lifecycle.options import LaunchOptions, options_set
from ddp_notebook.lifecycle.trackers import check_report_to

pytestmark = pytest.mark.unit


# ---- names, tags, report_to ---------------------------------------------------------------------

@pytest.mark.parametrize("bad", [3, "", "   ", "a\nb", "x" * 201, b"name"])
def test_a_bad_name_is_named(bad):
    with pytest.raises(LaunchOptionError, match="name must be"):
        check_name(bad)


def test_names_are_trimmed_and_none_is_none():
    assert check_name("  lr=0.1 ") == "lr=0.1" and check_name(None) is None


@pytest.mark.parametrize("bad, words", [
    ({"data": [1, 2]}, "tags['data'] is [1, 2]"),
    ({"x": None}, "tags['x'] is None"),
    ({"x": float("nan")}, "tags['x'] is nan"),
    ({"x": "a" * 251}, "tags['x'] is 'aaa"),
    ({"x": "two\nlines"}, "tags['x']"),
    ({"": 1}, "tags has the key ''"),
    ({"a=b": 1}, "tags has the key 'a=b'"),
    ({3: 1}, "tags has the key 3"),
    (["lr", 0.1], "tags must be a dict"),
    ({f"k{i}": i for i in range(51)}, "tags has 51 entries"),
])
def test_tags_that_are_not_short_scalars_are_named(bad, words):
    with pytest.raises(LaunchOptionError, match="^" + __import__("re").escape(words)):
        check_tags(bad)


def test_short_scalars_are_tags():
    tags = {"arch": "cnn", "lr": 0.1, "layers": 3, "aug": True, "group/run:1": "a b"}
    assert check_tags(tags) == tags and check_tags(None) == {}


@pytest.mark.parametrize("bad, words", [("tensorbord", "report_to names 'tensorbord'"),
                                        ([42], "report_to has int 42"),
                                        ("", "report_to names ''")])
def test_report_to_names_what_is_not_a_tracker(bad, words):
    with pytest.raises(LaunchOptionError, match="^" + __import__("re").escape(words)):
        check_report_to(bad)


def test_report_to_takes_names_lists_and_objects():
    class Logger:
        def log(self, metrics, step):
            pass

    logger = Logger()
    assert check_report_to(["MLflow", "tensorboard", "mlflow"]) == ("mlflow", "tensorboard")
    assert check_report_to(logger) == (logger,) and check_report_to([]) is None


def test_launch_options_check_the_record_options():
    options = LaunchOptions(name=" a run ", tags={"lr": 0.1}, report_to="wandb")
    assert (options.name, options.tags, options.report_to) == ("a run", {"lr": 0.1}, ("wandb",))
    with pytest.raises(LaunchOptionError, match="name must be"):
        LaunchOptions(name=7)


def test_a_config_records_the_options_set_but_never_env_values():
    options = LaunchOptions(timeout=60.0, env={"WANDB_API_KEY": "secret"}, name="n", tags={"a": 1},
                            run_root="/tmp/x", report_to="mlflow")
    assert options_set(options) == {"timeout": 60.0, "env": ["WANDB_API_KEY"]}


# ---- summaries ----------------------------------------------------------------------------------

def test_values_are_kept_as_they_are_and_data_is_summarized():
    assert summarize(0.1) == 0.1 and summarize(3) == 3 and summarize("adam") == "adam" and summarize(None) is None
    assert summarize([1, (2, 3), {"a": None}]) == [1, [2, 3], {"a": None}]
    assert summarize(float("inf")) == "inf" and summarize(np.float32(0.5)) == 0.5 and summarize(np.int64(4)) == 4
    assert summarize(torch.zeros(896, 8)) == "Tensor[896, 8] float32"
    assert summarize(np.zeros((3, 4), dtype=np.float64)) == "ndarray[3, 4] float64"
    assert summarize(torch.tensor(0.25)) == 0.25  # a 0-d tensor is its number
    assert summarize(torch.nn.Linear(8, 1)) == "Linear (9 parameters)" and summarize(torch.nn.MSELoss()) == "MSELoss()"
    assert summarize(torch.utils.data.TensorDataset(torch.zeros(10, 2))) == "TensorDataset[10]"
    assert summarize(list(range(100))) == "list[100]" and summarize("x" * 500).startswith("x" * 200 + "…")
    assert summarize(b"abc") == "bytes[3]"
    assert summarize(torch.optim.SGD) == "torch.optim.SGD"


def test_an_object_whose_attributes_raise_is_named_by_its_type():
    class Hostile:
        def __getattr__(self, name):
            raise RuntimeError("no")

        def __repr__(self):
            raise RuntimeError("no repr either")

    assert summarize(Hostile()).endswith("Hostile")


def test_functions_are_named_lambdas_by_their_text_with_what_they_read():
    lr = 0.03
    optimizer = lambda p: torch.optim.SGD(p, lr=lr)  # noqa: E731 - what a user passes to fit
    assert describe_callable(optimizer) == "lambda p: torch.optim.SGD(p, lr=lr) [lr=0.03]"
    inline = {"optimizer": lambda p: torch.optim.Adam(p, lr=3e-4), "other": 1}
    assert describe_callable(inline["optimizer"]) == "lambda p: torch.optim.Adam(p, lr=0.0003)"
    assert describe_callable(functools.partial(torch.optim.SGD, lr=0.1)) == "functools.partial(torch.optim.SGD, lr=0.1)"
    assert describe_callable(math.sqrt) == "math.sqrt"


def test_a_call_is_bound_to_the_parameter_names_with_their_defaults():
    def train(ctx, data, steps, lr=0.1, *more, scale=2, **rest):
        pass

    config = call_config(train, "ctx", (torch.zeros(4, 2), 100, 0.5, "x"), {"momentum": 0.9})
    assert config == {"data": "Tensor[4, 2] float32", "steps": 100, "lr": 0.5, "more": ["x"], "scale": 2,
                      "momentum": 0.9}
    assert call_config(lambda rank, n: None, "rank", (3,), {}) == {"n": 3}
    assert call_config(min, "ctx", (1, 2), {"key": None}) == {"args": [1, 2], "key": None}  # no signature to bind


def test_the_code_fingerprint_changes_with_the_code():
    def a(x):
        return x + 1

    def b(x):
        return x + 2

    assert code_fingerprint([a]) == code_fingerprint([a]) != code_fingerprint([b])
    assert code_fingerprint([torch.nn.Linear(2, 2)]) == code_fingerprint([torch.nn.Linear(3, 1)])  # the class's code
    assert code_fingerprint([None, 3]) is None


def test_what_differs_between_configs():
    configs = [{"lr": 0.1, "epochs": 3, "data": "T[4]"}, {"lr": 0.01, "epochs": 3, "data": "T[4]"},
               {"lr": 0.01, "epochs": 3, "data": "T[4]", "seed": 1}]
    assert differing(configs) == ["lr", "seed"] and differing([]) == [] and differing(configs[:1]) == []


# ---- the record in the state --------------------------------------------------------------------

START = {"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"], "name": "base",
         "tags": {"arch": "mlp"}, "config": {"lr": 0.1}, "origin": "fit", "monitor": "valid_loss",
         "monitor_mode": "min", "code": "abc", "versions": {"python": "3.11"}, "cwd": "/nb"}


def feed(*events):
    s = RunState()
    for e in events:
        s.apply(e)
    return s


def test_every_value_rank0_logged_makes_its_series_and_the_monitored_best():
    points = [[1.0, step, step // 10, {"loss": 1.0 / step}] for step in range(1, 31)]
    points += [[2.0, 10, 0, {"valid_loss": 0.5}], [3.0, 20, 1, {"valid_loss": 0.3}], [4.0, 30, 2, {"valid_loss": 0.4}]]
    s = feed(START, {"kind": "progress", "time": 1, "rank": 0, "metrics": {"loss": 1 / 30}, "points": points},
             {"kind": "progress", "time": 1, "rank": 1, "metrics": {}, "points": [[1.0, 1, 0, {"other": 9.0}]]},
             {"kind": "ready", "time": 1, "rank": 0, "torch": "2.13.0"},
             {"kind": "provenance", "time": 2, "git_commit": "f00", "git_dirty": False})
    assert len(s.series["loss"]) == 30 and s.series["valid_loss"] == [(10.0, 0.5), (20.0, 0.3), (30.0, 0.4)]
    assert "other" not in s.series  # rank 0's record only
    assert s.best == {"value": 0.3, "step": 20, "epoch": 1}
    assert s.metrics["valid_loss.min"] == 0.3 and s.headline_metric == ("valid_loss (min)", 0.3)
    assert (s.name, s.tags, s.config, s.origin, s.cwd, s.code) == ("base", {"arch": "mlp"}, {"lr": 0.1}, "fit", "/nb",
                                                                  "abc")
    assert s.versions == {"python": "3.11", "torch": "2.13.0", "git_commit": "f00", "git_dirty": False}


def test_a_max_monitor_keeps_the_highest_and_a_series_stays_bounded():
    s = feed(dict(START, monitor="acc", monitor_mode="max"),
             {"kind": "progress", "time": 1, "rank": 0, "metrics": {},
              "points": [[1.0, i, None, {"acc": (i % 7) / 7, "nan": float("nan")}] for i in range(5 * SERIES_KEPT)]})
    assert s.best["value"] == 6 / 7 and s.metrics["acc.max"] == 6 / 7
    assert SERIES_KEPT // 2 <= len(s.series["acc"]) <= SERIES_KEPT and "nan" not in s.series


def test_values_logged_without_a_step_are_counted_and_marked():
    s = feed(START, {"kind": "progress", "time": 1, "rank": 0, "metrics": {},
                     "points": [[1.0, None, e, {"valid_loss": 1.0 / (e + 1)}] for e in range(3)]})
    assert s.series["valid_loss"] == [(1.0, 1.0), (2.0, 0.5), (3.0, 1 / 3)] and s.unstepped == {"valid_loss"}
    assert s.series_epochs["valid_loss"] == [0, 1, 2]


def test_peak_memory_comes_from_reports_and_outcomes_and_only_grows():
    s = feed(START, {"kind": "progress", "time": 1, "rank": 1, "metrics": {}, "memory": {"rss": 500}},
             {"kind": "progress", "time": 2, "rank": 1, "metrics": {}, "memory": {"rss": 300, "cuda": 7}},
             {"kind": "done", "time": 3, "rank": 0, "memory": {"rss": 900}},
             {"kind": "error", "time": 3, "rank": 1, "exc_type": "X", "memory": {"rss": 400}})
    assert (s.workers[0].peak_rss, s.workers[1].peak_rss, s.workers[1].peak_cuda) == (900, 500, 7)
    assert s.metrics["rank1.peak_rss"] == 500 and s.metrics["rank1.peak_cuda"] == 7


def test_the_epochs_are_rows_counted_from_zero():
    records = [{"epoch": 0, "seconds": 1.0, "metrics": {"valid_loss": 0.4}, "loss_mean": 0.5, "losses": 10},
               {"epoch": 1, "seconds": 1.5, "metrics": {"train_loss": 0.3, "valid_loss": 0.2}}]
    s = feed(START, {"kind": "progress", "time": 1, "rank": 0, "metrics": {}, "epoch_records": records})
    assert s.history == [{"epoch": 0, "train_loss": 0.5, "valid_loss": 0.4, "seconds": 1.0},
                         {"epoch": 1, "train_loss": 0.3, "valid_loss": 0.2, "seconds": 1.5}]


def test_the_end_of_a_run_states_its_record_and_a_list_reads_it_without_progress():
    s = feed(START, {"kind": "run_finished", "time": 5, "status": "succeeded", "metrics": {"loss": 0.1},
                     "best": {"value": 0.2, "step": 9, "epoch": 2}},
             {"kind": "tracker", "time": 5, "tracker": "mlflow", "message": "mlflow failed"},
             {"kind": "cell", "time": 5, "cell": 1}, {"kind": "cell", "time": 6, "cell": 2})
    assert s.metrics == {"loss": 0.1, "valid_loss.min": 0.2} and s.tracker_notes == ["mlflow failed"]
    assert s.cells == 2


# ---- what a new user tripped on, and an attack found ---------------------------------------------

def test_a_non_finite_value_is_a_number_in_the_record_and_to_the_trackers():
    from ddp_notebook.lifecycle.reporting import Reporter
    from ddp_notebook.lifecycle.trackers import ObjectTracker, RunRecord

    s = feed(START, {"kind": "progress", "time": 1, "rank": 0, "metrics": {"valid_loss": "nan", "big": "inf"}})
    assert math.isnan(s.metrics["valid_loss"]) and s.metrics["big"] == math.inf

    class Sink:
        def __init__(self):
            self.seen = []

        def log(self, metrics, step):
            self.seen.append((step, metrics))

    sink, notes = Sink(), []
    reporter = Reporter(RunRecord("r", "/nonexistent", None), [ObjectTracker(sink)], notes.append)
    reporter.on_event({"kind": "progress", "rank": 0, "points": [[1.0, 1, 0, {"valid_loss": 0.5}],
                                                                 [2.0, 2, 1, {"valid_loss": "nan"}]]})
    reporter.finish("failed", {}, wait=10)
    assert sink.seen[0] == (1, {"valid_loss": 0.5}) and math.isnan(sink.seen[1][1]["valid_loss"]) and not notes


def test_values_past_the_pending_bound_are_counted_by_value(monkeypatch):
    import threading

    from ddp_notebook.lifecycle import reporting
    from ddp_notebook.lifecycle.trackers import ObjectTracker, RunRecord

    monkeypatch.setattr(reporting, "PENDING_VALUES", 100)
    gate = threading.Event()

    class Stuck:
        def log(self, metrics, step):
            gate.wait(10)

    notes = []
    reporter = reporting.Reporter(RunRecord("r", "/nonexistent", None), [ObjectTracker(Stuck())], notes.append)
    point = [0.0, 1, None, {f"m{i}": 1.0 for i in range(50)}]  # one log of 50 values
    for _ in range(10):
        reporter.on_event({"kind": "progress", "rank": 0, "points": [point]})
    gate.set()
    reporter.finish("succeeded", {}, wait=10)
    said = [n["message"] for n in notes]
    assert any(m.startswith("the trackers fell behind: ") and int(m.split(": ")[1].split()[0]) >= 400
               for m in said), said  # 8 or more logs of 50 values left out, counted as values


def test_as_the_notebook_exits_a_trackers_backlog_is_cut_so_that_it_is_told_the_end_in_time():
    from ddp_notebook.lifecycle.reporting import Reporter
    from ddp_notebook.lifecycle.trackers import ObjectTracker, RunRecord

    class Slow:  # 1 ms a value: the backlog below takes 5 s
        def __init__(self):
            self.values, self.flushed = 0, 0

        def log(self, metrics, step):
            self.values += 1
            time.sleep(0.001)

        def flush(self):
            self.flushed += 1

    slow, notes = Slow(), []
    reporter = Reporter(RunRecord("r", "/nonexistent", None), [ObjectTracker(slow)], notes.append)
    for step in range(5000):
        reporter.on_event({"kind": "progress", "rank": 0, "points": [[0.0, step + 1, None, {"loss": 1.0}]]})
    started = time.monotonic()
    reporter.finish("stopped", {}, wait=2.0, last=True)
    assert time.monotonic() - started < 2.5 and slow.flushed == 1  # told the end (MLflow: KILLED, not RUNNING)
    assert 0 < slow.values < 5000
    assert [n["message"] for n in notes] == [f"the trackers fell behind: {5000 - slow.values} values were not sent "
                                             "to them"]


def test_a_tracker_that_fails_at_length_is_said_with_its_head_and_its_end():
    from ddp_notebook.lifecycle.reporting import Reporter
    from ddp_notebook.lifecycle.trackers import ObjectTracker, RunRecord

    class Wordy:
        def log(self, metrics, step):  # as MLflow's file store says it: the remedy last
            raise RuntimeError("The filesystem backend is in maintenance mode. " + "x" * 900
                               + " set `MLFLOW_ALLOW_FILE_STORE=true` to opt out")

    notes = []
    reporter = Reporter(RunRecord("r", "/nonexistent", None), [ObjectTracker(Wordy())], notes.append)
    reporter.on_event({"kind": "progress", "rank": 0, "points": [[1.0, 1, 0, {"loss": 0.5}]]})
    reporter.finish("succeeded", {}, wait=10)
    [message] = [n["message"] for n in notes]
    assert message.startswith("Wordy failed in log(): RuntimeError: The filesystem backend is in maintenance")
    assert message.endswith("set `MLFLOW_ALLOW_FILE_STORE=true` to opt out; nothing more is sent to it")
    assert len(message) < 700


def test_an_epoch_a_stop_cut_short_is_no_epoch_of_the_history():
    from ddp_notebook.worker.loss_history import LossHistory

    h = LossHistory(clock=iter(range(100)).__next__)
    for step in (1, 2):
        h.add(step, 0, {"loss": 1.0})
    h.add(None, 0, {"valid_loss": 0.5})
    h.add(3, 1, {"loss": 0.5})  # epoch 1 begins, and a stop cuts it
    h.cut(1)
    h.close()
    s = feed(START, {"kind": "progress", "time": 1, "rank": 0, "metrics": {}, **h.attach({})})
    assert [r["epoch"] for r in s.history] == [0] and s.workers[0].epoch_history[-1]["cut"]


def test_a_config_entry_named_as_a_metric_and_dollars_in_names():
    from ddp_notebook.lifecycle.experiments import ListedRun
    from ddp_notebook.ui.comparison import Comparison

    def state(run_id, name, loss_fn, value):
        return feed(dict(START, run_id=run_id, name=name, config={"loss": loss_fn, "epochs": 3}),
                    {"kind": "progress", "time": 1, "rank": 0, "metrics": {"loss": value},
                     "points": [[1.0, 1, None, {"loss": value}]]})

    listed = [ListedRun("a", "/nonexistent/a", None, state("a", "a $\\x$ b", "MSELoss()", 0.5)),
              ListedRun("b", "/nonexistent/b", None, state("b", "budget $5", "L1Loss()", 0.25))]
    comparison = Comparison(listed)
    lines = repr(comparison).splitlines()
    assert lines[0].split() == ["run", "status", "duration", "devices", "loss", "(config)", "loss"]
    assert "MSELoss()" in lines[1] and "0.5" in lines[1] and "L1Loss()" in lines[2]
    assert comparison.rows()[0]["config"] == {"loss": "MSELoss()"} and comparison.rows()[0]["metrics"] == {"loss": 0.5}
    assert comparison.plot_png().startswith(b"\x89PNG")  # a "$" is drawn as written, never as math
    assert "—" not in lines[1]  # both runs have the entry


def test_lists_keep_the_end_of_a_long_value_and_large_numbers_read_right():
    from ddp_notebook.ui.text import format_metric, format_runs

    runs = [feed(dict(START, run_id=f"20260101-00000{i}-aaaaa{i}", name=None,
                      config={"optimizer": f"lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9) [lr={lr}]"}))
            for i, lr in enumerate((0.1, 0.01))]
    rows = format_runs(runs)
    assert rows[1].rstrip().endswith("[lr=0.1]") and rows[2].rstrip().endswith("[lr=0.01]")
    assert format_metric(6.77e33) == "6.77e+33" and format_metric(2.3e17) == "2.3e+17"
    # Beside runs of another function (every key differs between the two kinds): still told apart
    # by what differs among their own kind (the lr was cut away, in the middle of every key).
    fits = [feed(dict(START, run_id=f"20260101-00001{i}-bbbbb{i}", name=None,
                      config={"function": "fit", "model": "mlp", "epochs": 3, "batch_size": 32, "seed": 0,
                              "optimizer": f"lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9) [lr={lr}]"}))
            for i, lr in enumerate((0.1, 0.01))]
    loops = [feed(dict(START, run_id=f"20260101-00002{i}-ccccc{i}", name=None,
                       config={"function": "train", "lr": lr, "steps": 300})) for i, lr in enumerate((0.5, 0.05))]
    rows = format_runs([*fits, *loops])
    assert [row.rstrip().endswith(end) for row, end in zip(rows[1:], ("[lr=0.1]", "[lr=0.01]", "lr=0.5", "lr=0.05"))] \
        == [True] * 4, rows
    alone = format_runs([*fits, loops[0]])  # a function with one run listed: its name
    assert alone[3].rstrip().endswith("function=train"), alone


@pytest.mark.parametrize("bad", ["a\rb", "a\u2028b", "a\x1bb", "\u202eevil", "a\u2067b"])
def test_names_and_tags_are_on_one_line(bad):
    with pytest.raises(LaunchOptionError, match="name must be"):
        check_name(bad)
    with pytest.raises(LaunchOptionError, match="tags\\['x'\\]"):
        check_tags({"x": bad})


def test_tag_keys_of_any_script_and_booleans_as_a_command_line_writes_them():
    from ddp_notebook.ui.magics import _tag

    assert check_tags({"é": 1, "学习率": 0.1}) == {"é": 1, "学习率": 0.1}  # letters (it said so, and refused them)
    assert [_tag(t) for t in ("debug=true", "b=FALSE", "c=True", "d=truth")] == [
        ("debug", True), ("b", False), ("c", True), ("d", "truth")]


def test_report_to_none_is_no_tracker_in_a_list_too():
    assert check_report_to("none") is None and check_report_to(["none"]) is None
    assert check_report_to(["None", "mlflow"]) == ("mlflow",)
