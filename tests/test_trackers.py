"""report_to= with real runs and real trackers: TensorBoard's event files read back with
TensorBoard's own reader, an MLflow store read back with MlflowClient, a W&B offline run read back
with W&B's own inspector, and trackers that are missing, fail or hang."""
import glob
import json
import os
import subprocess
import sys
import threading
import time

import pytest
import torch

import ddp_notebook
from ddp_notebook import WorkerFailedError
from ddp_notebook.errors import LaunchOptionError
from ddp_notebook.lifecycle import reporting

import models
from helpers import started_processes, wait_for

pytestmark = pytest.mark.trackers

STEPS = 300  # every one logged, far faster than progress_interval (0.1 s): throttling would lose values


def every_step(ctx, steps):
    for step in range(1, steps + 1):
        ctx.log(step=step, total=steps, loss=1.0 / step, acc=step / steps)
    return "done"


def logs_then(ctx, then):
    """Rank 0 logs steps 1..5; then rank 1 raises ("raise") or both loop until stopped ("wait")."""
    import torch.distributed as dist

    if ctx.rank == 0:
        for step in range(1, 6):
            ctx.log(step=step, loss=float(step))
    ctx.flush()
    dist.barrier()
    if then == "raise" and ctx.rank == 1:
        raise ValueError("rank 1 gives up")
    while not ctx.should_stop:
        time.sleep(0.01)
    return None


def rank0_points(run):
    """Every point rank 0 sent, from the run's own event log: [(step, {name: value})]."""
    points = []
    with open(run.dir.events_path) as f:
        for line in f:
            event = json.loads(line)
            if event.get("kind") == "progress" and event.get("rank") == 0:
                points += [(step, values) for _t, step, _epoch, values in event.get("points") or ()]
    return points


class Recorder:
    """A tracker object: anything with log(metrics, step)."""

    def __init__(self):
        self.calls = []
        self.flushed = 0

    def log(self, metrics, step):
        self.calls.append((step, dict(metrics)))

    def flush(self):
        self.flushed += 1


class Raises:
    def log(self, metrics, step):
        raise RuntimeError("tracker down")


class Hangs:
    def __init__(self):
        self.entered = threading.Event()
        self.release = threading.Event()

    def log(self, metrics, step):
        self.entered.set()
        self.release.wait(30)


# ---- TensorBoard -----------------------------------------------------------------------------------
def test_tensorboard_gets_every_value_at_its_step_and_the_config_as_hparams(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2
    from torch.utils.tensorboard import SummaryWriter

    mine = SummaryWriter(log_dir=str(tmp_path / "mine"))
    try:
        run = ddp_notebook.launch(every_step, devices="cpu*2", args=(STEPS,), run_root=str(tmp_path),
                                  report_to=["tensorboard", mine], name="tb", tags={"arch": "mlp"})
        assert run.wait(timeout=60) == "done"
        assert run.state.tracker_notes == []
        assert run.state.report_to == ["tensorboard", "SummaryWriter"]

        def scalars(folder):
            acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
            acc.Reload()
            return acc, {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

        expected_loss = [(s, pytest.approx(1.0 / s)) for s in range(1, STEPS + 1)]
        expected_acc = [(s, pytest.approx(s / STEPS)) for s in range(1, STEPS + 1)]
        acc, own = scalars(os.path.join(run.run_dir, "tb", "tb"))  # TensorBoard names the run by its folder
        assert own["loss"] == expected_loss and own["acc"] == expected_acc  # once each: no point added at the end
        # the name, tags and config as hparams, the series as its metrics
        content = acc.PluginTagToContent("hparams")
        data = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
        hparams = {k: v.string_value or v.number_value for k, v in data.session_start_info.hparams.items()}
        assert hparams == {"name": "tb", "tag.arch": "mlp", **run.config} and run.config["steps"] == STEPS
        experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
        assert {m.name.tag for m in experiment.metric_infos} == {"loss", "acc"}

        # the user's writer: the same scalars, flushed (readable now), and still open
        assert mine.file_writer is not None
        _, theirs = scalars(tmp_path / "mine")
        assert theirs["loss"] == expected_loss and theirs["acc"] == expected_acc
        assert not any(tag.startswith("hparams") for tag in theirs)
        mine.add_scalar("after", 1.0, 1)
    finally:
        mine.close()


# ---- MLflow ----------------------------------------------------------------------------------------
@pytest.fixture
def mlflow_store(tmp_path, monkeypatch):
    """An MLflow file store in tmp_path as the tracking URI, experiment "x" the active one; the
    tracking URI, the experiment and their environment variables put back after."""
    mlflow = pytest.importorskip("mlflow")
    previous = mlflow.get_tracking_uri()
    for var in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store: no database to create (seconds)
    mlflow.set_tracking_uri((tmp_path / "mlruns").as_uri())
    experiment = mlflow.set_experiment("x")
    yield mlflow, experiment
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(previous)


def test_mlflow_run_has_the_name_tags_config_and_every_value_at_its_step(tmp_path, mlflow_store):
    mlflow, experiment = mlflow_store
    client = mlflow.MlflowClient()
    theirs = mlflow.start_run(run_name="the user's own")  # in this (the main) thread: left alone
    x, y = models.regression_data(n=256)
    result = ddp_notebook.fit(model=models.linear, train_data=(x[:192], y[:192]), valid_data=(x[192:], y[192:]),
                              loss=torch.nn.MSELoss(), optimizer=models.sgd(0.1), epochs=3, batch_size=32,
                              devices="cpu*2", run_root=str(tmp_path), report_to="mlflow", name="lr-0.1",
                              tags={"arch": "mlp"})
    run = result.run
    assert run.state.tracker_notes == []
    assert mlflow.active_run().info.run_id == theirs.info.run_id
    mlflow.log_metric("still_mine", 1.0)
    [ours] = [r for r in client.search_runs([experiment.experiment_id]) if r.info.run_id != theirs.info.run_id]
    assert ours.info.run_name == "lr-0.1" and ours.info.status == "FINISHED"
    assert ours.data.tags["arch"] == "mlp" and ours.data.tags["ddp_notebook.run_id"] == run.id
    assert "mlflow.parentRunId" not in ours.data.tags
    assert ours.data.params == {k: str(v) for k, v in run.config.items()}
    points = rank0_points(run)
    for name in ("loss", "train_loss", "valid_loss"):
        history = [(m.step, m.value) for m in client.get_metric_history(ours.info.run_id, name)]
        assert history == [(step, pytest.approx(v[name])) for step, v in points if name in v], name
    assert [h["valid_loss"] for h in run.history] == \
        [m.value for m in client.get_metric_history(ours.info.run_id, "valid_loss")]
    assert ours.data.metrics["valid_loss.min"] == pytest.approx(run.metrics["valid_loss.min"])
    assert ours.data.metrics["rank0.peak_rss"] == run.metrics["rank0.peak_rss"]
    mine = client.get_run(theirs.info.run_id)
    assert mine.info.status == "RUNNING" and mine.data.metrics == {"still_mine": 1.0}
    mlflow.end_run()


def test_mlflow_run_ends_failed_or_killed(tmp_path, mlflow_store):
    mlflow, experiment = mlflow_store
    client = mlflow.MlflowClient()
    failing = ddp_notebook.launch(logs_then, devices="cpu*2", args=("raise",), run_root=str(tmp_path),
                                  report_to="mlflow", name="failing", kill_grace=1.0)
    with pytest.raises(WorkerFailedError):
        failing.wait(timeout=60)
    stopped = ddp_notebook.launch(logs_then, devices="cpu*2", args=("wait",), run_root=str(tmp_path),
                                  report_to="mlflow", name="stopped")
    wait_for(stopped, lambda s: s.workers[0].step == 5)
    stopped.stop(wait=True)
    runs = {r.info.run_name: r for r in client.search_runs([experiment.experiment_id])}
    assert runs["failing"].info.status == "FAILED" and runs["stopped"].info.status == "KILLED"
    for name in ("failing", "stopped"):
        history = client.get_metric_history(runs[name].info.run_id, "loss")
        assert [(m.step, m.value) for m in history] == [(s, float(s)) for s in range(1, 6)], name
    assert failing.state.tracker_notes == [] and stopped.state.tracker_notes == []


# ---- W&B -------------------------------------------------------------------------------------------
def test_wandb_offline_run_has_the_config_summary_and_history(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_PROJECT", "trackers-test")
    try:
        theirs = wandb.init(project="the-users-own")  # the notebook's own run: left alone
        run = ddp_notebook.launch(every_step, devices="cpu*2", args=(50,), run_root=str(tmp_path / "runs"),
                                  report_to="wandb", name="wb", tags={"arch": "mlp"})
        assert run.wait(timeout=60) == "done"
        assert wandb.run is theirs and theirs.project == "the-users-own"
        theirs.log({"mine": 1.0})
        theirs_dir = theirs.dir  # <its folder>/files
        theirs.finish()
    finally:
        wandb.teardown()  # W&B's service process (wandb-core) ends with it
    assert run.state.tracker_notes == []
    [folder] = set(glob.glob(str(tmp_path / "wandb" / "offline-run-*"))) - {os.path.dirname(theirs_dir)}
    # W&B's own reader of its transaction log
    inspect = [sys.executable, "-m", "wandb", "leet", "inspect", "--json", folder]
    done = subprocess.run(inspect, capture_output=True, text=True, timeout=60)
    if done.returncode and "No such command" in done.stderr:
        pytest.skip(f"wandb {wandb.__version__} has no `wandb leet inspect` to read its offline run back")
    assert done.returncode == 0, done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines()]
    [started] = [r["run"] for r in records if r["type"] == "run"]
    assert started["display_name"] == "wb" and started["project"] == "trackers-test"
    assert started["tags"] == ["arch=mlp"]
    config = {k: v for k, v in started["config"]["update"].items() if not k.startswith("_")}
    assert config == run.config
    history = [(r["history"]["step"]["num"], r["history"]["item"]) for r in records if r["type"] == "history"]
    assert [(int(step), item["loss"], item["acc"]) for step, item in history] == \
        [(s, pytest.approx(1.0 / s), pytest.approx(s / 50)) for s in range(1, 51)]
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    assert summary["loss"] == pytest.approx(1.0 / 50) and summary["rank0.peak_rss"] == run.metrics["rank0.peak_rss"]
    [ended] = [r["exit"] for r in records if r["type"] == "exit"]
    assert ended.get("exit_code", 0) == 0


# ---- trackers that are missing, fail or hang ---------------------------------------------------------
def test_a_missing_library_and_a_failing_tracker_are_one_line_each_and_the_rest_goes_on(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlflow", None)  # import mlflow fails, in this process only
    good = Recorder()
    run = ddp_notebook.launch(every_step, devices="cpu*2", args=(STEPS,), run_root=str(tmp_path),
                              report_to=["mlflow", Raises(), good])
    assert run.wait(timeout=60) == "done" and run.status == "succeeded"
    notes = run.state.tracker_notes
    assert len(notes) == 2, notes
    assert "report_to='mlflow' needs mlflow (pip install mlflow): the run goes on without it" in notes[0]
    assert "Raises failed in log(): RuntimeError: tracker down; nothing more is sent to it" in notes[1]
    assert [step for step, _ in good.calls] == list(range(1, STEPS + 1))
    assert good.calls[-1] == (STEPS, {"loss": pytest.approx(1.0 / STEPS), "acc": pytest.approx(1.0)})
    assert good.flushed == 1


def test_a_tracker_that_hangs_does_not_hold_the_run(tmp_path, monkeypatch):
    monkeypatch.setattr(reporting, "FINISH_WAIT", 1.0)
    hangs = Hangs()
    try:
        run = ddp_notebook.launch(every_step, devices="cpu*2", args=(20,), run_root=str(tmp_path),
                                  report_to=hangs)
        assert hangs.entered.wait(60)
        t0 = time.monotonic()
        assert run.wait(timeout=60) == "done"
        waited = time.monotonic() - t0
    finally:
        hangs.release.set()
    assert waited < 1.0 + 6.0, waited  # not the 30 s of the hang, nor the default FINISH_WAIT
    assert run.status == "succeeded"
    assert run.state.tracker_notes == ["Hangs still busy 1 s after the run ended: it goes on in the background"]


@pytest.mark.parametrize("options, named", [
    ({"report_to": "tensorbord"}, "'tensorbord'"),
    ({"report_to": [42]}, "int 42"),
    ({"report_to": ["tensorboard", "nope"]}, "'nope'"),
    ({"tags": {"x": [1]}}, "[1]"),
    ({"name": 3}, "3"),
    ({"trial": "not a trial"}, "'not a trial'"),
    ({"trial": "trial without monitor"}, "monitor="),
])
def test_bad_tracker_options_are_refused_before_anything_starts(tmp_path, options, named):
    if options.get("trial") == "trial without monitor":
        optuna = pytest.importorskip("optuna")
        options = {"trial": optuna.create_study().ask()}
    before = started_processes()
    with pytest.raises(LaunchOptionError) as raised:
        ddp_notebook.launch(every_step, devices="cpu*2", args=(1,), run_root=str(tmp_path), **options)
    assert named in str(raised.value)
    assert started_processes() <= before and os.listdir(tmp_path) == []


def test_fit_and_spawn_refuse_them_too(tmp_path):
    x, y = models.regression_data(n=64)
    fit_args = dict(model=models.linear, train_data=(x, y), loss=torch.nn.MSELoss(), optimizer=models.sgd(0.1),
                    epochs=1, batch_size=32, devices="cpu*2", run_root=str(tmp_path))
    before = started_processes()
    with pytest.raises(LaunchOptionError, match="'tensorbord'"):
        ddp_notebook.fit(report_to="tensorbord", **fit_args)
    with pytest.raises(LaunchOptionError, match="'not a trial'"):
        ddp_notebook.fit(trial="not a trial", **fit_args)
    with pytest.raises(LaunchOptionError, match="int 42"):
        ddp_notebook.spawn(every_step, args=(1,), nprocs=2, run_root=str(tmp_path), report_to=[42])
    assert started_processes() <= before and os.listdir(tmp_path) == []


FRESH_NOTEBOOK = """
import sys, ddp_notebook
def every_step(ctx, steps):
    for step in range(1, steps + 1):
        ctx.log(step=step, loss=1.0 / step)
assert "torch" not in sys.modules  # a notebook that has not imported torch
for _ in range(3):  # each launch right after the last, while its tracker starts
    run = ddp_notebook.launch(every_step, devices="cpu*2", args=(50,), report_to="tensorboard", run_root={root!r})
    run.wait(timeout=120)
    assert not run.state.tracker_notes, run.state.tracker_notes
print("ok")
"""


def test_a_notebook_without_torch_imported_survives_tensorboard_launches(tmp_path):
    # torch imported by the reporter's thread while the notebook's thread imported torch.distributed
    # for the next launch aborted the process ("terminate called after throwing an instance of
    # 'python_error'") 2 times in 6: the writer is imported on the launching thread.
    done = subprocess.run([sys.executable, "-c", FRESH_NOTEBOOK.format(root=str(tmp_path))],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path))
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


EXITING_NOTEBOOK = """
import os, sys, time, mlflow, ddp_notebook
sys.path.insert(0, {tests!r})
import test_trackers
mlflow.set_tracking_uri({uri!r})
experiment = mlflow.set_experiment("x")
# Runs whose tracker takes 5 s to finish, more than the exit's 3 s: they take no other run's time.
slow = [ddp_notebook.launch(test_trackers.steps_until_stopped, devices="cpu:0", run_root={root!r},
                            report_to=test_trackers.SlowFlush()) for _ in range(2)]
run = ddp_notebook.launch(test_trackers.steps_until_stopped, devices="cpu*2", run_root={root!r},
                          report_to=["mlflow", "tensorboard"], name="cut")
client = mlflow.MlflowClient()
def taking():  # its tracker takes values: then the notebook exits
    try:
        return any(client.get_metric_history(r.info.run_id, "loss")
                   for r in client.search_runs([experiment.experiment_id]))
    except Exception:  # (a file store read as the run is made in it can fail)
        return False
deadline = time.monotonic() + 120
while not taking():
    assert time.monotonic() < deadline
    time.sleep(0.1)
print(run.run_dir, flush=True)
"""


class SlowFlush:
    def log(self, metrics, step):
        pass

    def flush(self):
        time.sleep(5)


def steps_until_stopped(ctx):
    step = 0
    while not ctx.should_stop:
        step += 1
        ctx.log(step=step, loss=1.0 / step)
        time.sleep(0.02)


def test_a_notebook_that_exits_mid_run_ends_its_tracker_runs_killed_with_the_values_its_log_holds(tmp_path,
                                                                                                  monkeypatch):
    # A kernel restarted (it exits on its own) mid-run: the MLflow run stayed RUNNING for ever, and
    # the trackers took values the ranks sent after the run's end was written (the log's last step
    # was behind theirs, 9 times in 10).
    mlflow = pytest.importorskip("mlflow")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a file store: no database to create (seconds)
    uri = (tmp_path / "mlruns").as_uri()
    script = EXITING_NOTEBOOK.format(tests=os.path.dirname(__file__), uri=uri, root=str(tmp_path / "runs"))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    run = ddp_notebook.Run.load(done.stdout.strip().splitlines()[-1])
    assert run.status == "stopped" and run.state.stop_reason.startswith(
        "the notebook process exited (kernel restart or shutdown) at step ")
    logged = [step for step, values in rank0_points(run) if "loss" in values]
    assert logged and logged == list(range(1, len(logged) + 1))
    client = mlflow.MlflowClient(tracking_uri=uri)
    [ours] = client.search_runs([client.get_experiment_by_name("x").experiment_id])
    assert ours.info.status == "KILLED"
    assert [m.step for m in client.get_metric_history(ours.info.run_id, "loss")] == logged
    acc = EventAccumulator(os.path.join(run.run_dir, "tb", "cut"), size_guidance={"scalars": 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == logged
