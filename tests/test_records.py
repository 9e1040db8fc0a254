"""A run knows what it was, with real workers: its name, tags and config, every value rank 0
logged (whatever the throttle), the monitored best, each rank's peak memory, its epochs, what
reproduces it; all of it read back by ``Run.load``; kept by the runs folder when named, tagged
or pinned; listed and compared by working directory."""
import json
import os
import subprocess
import time

import pytest
import torch

import ddp_notebook
from ddp_notebook.core.rundir import RunDir
from ddp_notebook.errors import ArgumentsError, DDPNotebookError, LaunchOptionError, RunLoadError
from ddp_notebook.lifecycle.experiments import find_runs, runs_of_here

pytestmark = pytest.mark.processes


@pytest.fixture
def runs_folder(tmp_path, monkeypatch):
    folder = tmp_path / "runs"
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", str(folder))
    here = tmp_path / "notebook"
    here.mkdir()
    monkeypatch.chdir(here)
    return folder


def logs_every_step(ctx, steps, lr=0.1):
    for epoch in ctx.epochs(3):
        for step in range(1, steps + 1):
            ctx.log(step=epoch * steps + step, total=3 * steps, loss=lr / step)
        ctx.log(epoch=epoch + 1, valid_loss=[0.5, 0.2, 0.3][epoch])  # "epoch + 1": ctx.epochs' own is kept
    return ctx.rank


def test_a_run_records_what_it_was_and_every_value_rank0_logged(runs_folder):
    subprocess.run(["git", "init", "-q"], check=True)
    subprocess.run(["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-q", "--allow-empty", "-m", "x"],
                   check=True)
    run = ddp_notebook.launch(logs_every_step, devices="cpu*2", args=(100,), kwargs={"lr": 0.01}, name="first",
                              tags={"arch": "mlp"}, monitor="valid_loss", timeout=600)
    assert run.wait(timeout=120) == 0
    assert (run.name, run.tags) == ("first", {"arch": "mlp"})
    assert run.config == {"function": "test_records.logs_every_step", "steps": 100, "lr": 0.01, "devices": "cpu:0,cpu:1",
                          "timeout": 600.0}
    # 300 logs in well under the throttle's interval each: every one is in the record
    assert [x for x, _ in run.state.series["loss"]] == [float(s) for s in range(1, 301)]
    assert run.metrics["valid_loss.min"] == 0.2 and run.state.best["epoch"] == 1
    assert run.metrics["rank0.peak_rss"] > 10**7 and run.metrics["rank1.peak_rss"] > 10**7
    assert [row["epoch"] for row in run.history] == [0, 1, 2] and run.history[1]["valid_loss"] == 0.2
    assert run.workers[0].epoch_text == "epoch 3/3"  # never "epoch 4/3"
    provenance = run.provenance
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert provenance["git_commit"] == head and provenance["git_dirty"] is False
    assert provenance["torch"] == torch.__version__ and provenance["ddp_notebook"] == ddp_notebook.__version__
    assert len(provenance["code"]) == 12 and provenance["cwd"] == os.getcwd()
    loaded = ddp_notebook.Run.load(run.id)  # as after a kernel restart
    for name in ("name", "tags", "config", "metrics", "history", "provenance"):
        assert getattr(loaded, name) == getattr(run, name), name
    assert loaded.state.series == run.state.series
    assert oct(os.stat(run.dir.events_path).st_mode & 0o777) == "0o600"


def test_fit_records_its_own_parameters_and_its_epochs_from_zero(runs_folder):
    x = torch.randn(256, 4)
    y = x.sum(1, keepdim=True)
    lr = 0.05
    result = ddp_notebook.fit(torch.nn.Linear(4, 1), (x[:192], y[:192]), valid_data=(x[192:], y[192:]),
                              loss=torch.nn.MSELoss(), optimizer=lambda p: torch.optim.SGD(p, lr=lr), epochs=3,
                              batch_size=32, devices="cpu*2", name="fit lr=0.05", tags={"lr": lr})
    run = result.run
    config = run.config
    assert config["function"] == "fit" and config["epochs"] == 3 and config["batch_size"] == 32
    assert config["model"] == "Linear (5 parameters)" and config["loss"] == "MSELoss()"
    assert config["optimizer"] == "lambda p: torch.optim.SGD(p, lr=lr) [lr=0.05]"
    assert config["train_data"] == ["Tensor[192, 4] float32", "Tensor[192, 1] float32"]
    assert [r["epoch"] for r in run.history] == [r["epoch"] for r in result.history] == [0, 1, 2]
    assert [r["valid_loss"] for r in run.history] == pytest.approx([r["valid_loss"] for r in result.history])
    assert run.metrics["valid_loss.min"] == pytest.approx(min(r["valid_loss"] for r in result.history))
    assert run.state.origin == "fit" and run.state.monitor == "valid_loss"


def test_a_retry_keeps_the_name_and_tags_and_says_what_it_retried(runs_folder):
    def fails_on_rank1(ctx):
        if ctx.rank == 1:
            raise ValueError("boom")
        return "ok"

    run = ddp_notebook.launch(fails_on_rank1, devices="cpu*2", name="flaky", tags={"try": 1})
    with pytest.raises(ddp_notebook.WorkerFailedError):
        run.wait(timeout=120)
    retry = run.retry()
    assert retry.wait(timeout=120) == "ok"
    assert (retry.name, retry.tags, retry.state.parent) == ("flaky", {"try": 1}, run.id)
    assert retry.config["devices"] == "cpu:0" and run.config["devices"] == "cpu:0,cpu:1"


def test_spawn_and_session_runs_say_what_they_are_and_a_session_records_no_call(runs_folder):
    def demo(rank, world_size, scale=2):
        return rank * scale

    assert ddp_notebook.spawn(demo, args=(1,), nprocs=1, name="spawned") == 0
    spawned = ddp_notebook.last_run()
    assert spawned.state.origin == "spawn" and spawned.config == {"function": "demo", "world_size": 1, "scale": 2,
                                                                 "devices": "cpu:0"}
    with ddp_notebook.session("cpu*2") as session:
        session.run("x = rank")
        run = session.current_run
        assert run.state.origin == "session" and run.config == {"devices": "cpu:0,cpu:1"}  # never its token
    assert run.wait(timeout=60) is None or True
    assert ddp_notebook.Run.load(run.id).state.cells == 1


def test_bad_record_options_are_named_and_start_nothing(runs_folder):
    def train(ctx):
        return 1

    for kwargs, words in (({"tags": {"x": [1]}}, "tags['x'] is [1]"), ({"name": 3}, "name must be text"),
                          ({"report_to": "tensorbord"}, "report_to names 'tensorbord'"),
                          ({"monitor": 3}, "monitor must be the name"), ({"mode": "low"}, "mode must be 'min'"),
                          ({"trial": "t", "monitor": "x"}, "trial must be the optuna.trial.Trial")):
        with pytest.raises(LaunchOptionError, match=words.replace("[", r"\[").replace("]", r"\]")):
            ddp_notebook.launch(train, devices="cpu*2", **kwargs)
    assert not runs_folder.exists() or not os.listdir(runs_folder)


def _fake_run(root, run_id, name=None, cwd="/elsewhere", status="succeeded", t=100.0):
    directory = RunDir(os.path.join(root, run_id))
    os.makedirs(directory.path, mode=0o700)
    with directory.open_log() as log:
        for event in ({"kind": "run_started", "time": t, "run_id": run_id, "devices": ["cpu:0"], "name": name,
                       "cwd": cwd, "config": {"lr": 0.1}},
                      {"kind": "progress", "time": t + 1, "rank": 0, "metrics": {"loss": 1.0},
                       "points": [[t + 1, 1, None, {"loss": 1.0}]]},
                      {"kind": "run_finished", "time": t + 2, "status": status}):
            log.write(json.dumps(event) + "\n")
    return directory


def test_named_tagged_and_pinned_runs_are_outside_the_limits_and_go_only_when_deleted(runs_folder):
    os.makedirs(runs_folder, mode=0o700)
    plain = [_fake_run(runs_folder, f"20260101-00000{i}-aaaaa{i}", t=100.0 + i) for i in range(3)]
    named = _fake_run(runs_folder, "20260101-000010-bbbbbb", name="keep me", t=90.0)
    tagged = RunDir(str(runs_folder / "20260101-000011-cccccc"))
    os.makedirs(tagged.path, mode=0o700)
    with tagged.open_log() as log:
        log.write(json.dumps({"kind": "run_started", "time": 91.0, "run_id": tagged.id, "devices": ["cpu:0"],
                              "tags": {"lr": 0.1}}) + "\n")
        log.write(json.dumps({"kind": "run_finished", "time": 92.0, "status": "stopped"}) + "\n")
    ddp_notebook.Run.load(plain[0].path).pin()
    removed = ddp_notebook.prune_runs(keep=0)
    assert sorted(os.path.basename(r.path) for r in removed) == [plain[1].id, plain[2].id]
    for kept in (plain[0], named, tagged):
        assert os.path.isdir(kept.path)
    pinned = ddp_notebook.Run.load(plain[0].path)
    pinned.unpin()
    assert [os.path.basename(r.path) for r in ddp_notebook.prune_runs(keep=0)] == [plain[0].id]
    loaded = ddp_notebook.Run.load(named.id[-6:])  # by the end of its id, as the magics take it
    loaded.delete()
    assert not os.path.exists(named.path)
    loaded.delete()  # gone already: nothing to do


def test_lists_and_comparisons_hold_this_directorys_runs_and_name_bad_ids(runs_folder, monkeypatch):
    def train(ctx, lr):
        for step in range(1, 21):
            ctx.log(step=step, loss=lr / step)
        return lr

    os.makedirs(runs_folder, mode=0o700)
    _fake_run(runs_folder, "20260101-000000-0aa5e1", cwd="/another/notebook")
    _fake_run(runs_folder, "20260101-000001-1aa5e1", cwd="/another/notebook")
    runs = [ddp_notebook.launch(train, devices="cpu*2", args=(lr,), name=f"lr={lr}") for lr in (0.1, 0.01)]
    for run in runs:
        run.wait(timeout=120)
    assert [r.id for r in runs_of_here()] == [r.id for r in runs]
    assert len(runs_of_here(everywhere=True)) == 4  # every run of the runs folder
    comparison = ddp_notebook.compare()
    assert comparison.run_ids == [r.id for r in runs] and comparison.metrics == ["loss"]
    assert comparison.differences()[0] == ["lr"] and "lr=0.1" in repr(comparison)
    rows = comparison.rows()
    assert [(r["run"], r["config"]["lr"], r["status"]) for r in rows] == [("lr=0.1", 0.1, "succeeded"),
                                                                ("lr=0.01", 0.01, "succeeded")]
    frame = comparison.frame()
    assert list(frame.columns[:5]) == ["run_id", "name", "status", "start_time", "end_time"]
    assert list(frame["config.lr"]) == [0.1, 0.01] and "metrics.loss" in frame and "tags.lr" not in frame
    assert str(frame["start_time"].dt.tz) == "UTC"
    broken = _fake_run(runs_folder, "20260101-000002-2aa5e1", cwd=os.getcwd())
    with open(broken.events_path, "a") as log:
        log.write("garbage\n")  # one line that is no event: the run cannot be read
    theirs = _fake_run(runs_folder, "20260101-000003-3aa5e1", name="not yours", cwd=os.getcwd())
    for folder, _, files in os.walk(theirs.path):
        for name in [folder, *(os.path.join(folder, f) for f in files)]:
            os.chown(name, 4242, 4242)  # another user's run, planted in the folder
    here = ddp_notebook.compare()  # the good runs compared, the unreadable one said, the other user's never listed
    assert here.run_ids == [r.id for r in runs] and len(here.unreadable) == 1 and broken.id in here.unreadable[0]
    assert "left out, its log cannot be read: 20260101-000002-2aa5e1" in repr(here) and "cannot be read" in here.html()
    # Shown as text alone where asked (ui=, or $DDP_NOTEBOOK_UI), never a widget in any form.
    assert list(ddp_notebook.compare(ui="text")._repr_mimebundle_()) == ["text/plain"]
    assert set(ddp_notebook.compare(ui="widget")._repr_mimebundle_()) == {"text/plain", "text/html"}
    monkeypatch.setenv("DDP_NOTEBOOK_UI", "text")
    assert list(ddp_notebook.compare()._repr_mimebundle_()) == ["text/plain"]
    with pytest.raises(ddp_notebook.errors.LaunchOptionError, match="ui must be 'widget', 'html', 'text' or None"):
        ddp_notebook.compare(ui="pretty")
    with pytest.raises(RunLoadError, match="cannot be read as a run's"):  # named, it must be read
        ddp_notebook.compare(broken.id)
    everything = ddp_notebook.compare(everywhere=True, last=3)
    assert everything.run_ids == ["20260101-000001-1aa5e1", runs[0].id, runs[1].id]
    assert "metrics.loss" in everything.frame()
    assert ddp_notebook.compare(runs[1].id[-6:], runs[0]).run_ids == [runs[1].id, runs[0].id]
    twice = ddp_notebook.compare(runs[1], runs[0], runs[1].id, metrics=["loss", "loss"])
    assert twice.run_ids == [runs[1].id, runs[0].id] and twice.metrics == ["loss"]  # each once
    with pytest.raises(RunLoadError, match=r"^no run 'nope' in this kernel nor in "):
        ddp_notebook.compare("nope")
    with pytest.raises(RunLoadError, match=r"^'aa5e1' ends 4 run ids \(20260101-000000-0aa5e1, 20260101-000001-1aa5e1, "
                                           r"20260101-000002-2aa5e1, 20260101-000003-3aa5e1\)"):
        ddp_notebook.compare("aa5e1")  # (5 hex digits: a real run ends so once in a million)
    with pytest.raises(ArgumentsError, match=r"^no run of this comparison logged 'acc': they logged loss$"):
        ddp_notebook.compare(*runs, metrics=["acc"])
    with pytest.raises(ArgumentsError, match="last must be a whole number >= 1"):
        ddp_notebook.compare(last=0)
    with pytest.raises(ArgumentsError, match="a run is given as a Run, its id or the end of its id"):
        find_runs([3])
    png = comparison.plot_png()
    assert png.startswith(b"\x89PNG") and "<img" in comparison.html() and "lr=0.01" in comparison.html()


def logs_a_coloured_name(ctx):
    ctx.log(step=1, total=1, **{"loss": 0.5, "m\x1b[31mRED\x1b[0m": 1.0})


def test_a_comparison_shows_names_and_values_a_rank_wrote_on_one_line_without_escapes(runs_folder):
    import warnings

    runs = [ddp_notebook.launch(logs_a_coloured_name, devices="cpu*2", ui="text") for _ in range(2)]
    for run in runs:
        run.wait(timeout=120)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (matplotlib warned of a glyph it cannot draw: the escape)
        shown = ddp_notebook.compare(*runs)._repr_mimebundle_()
    assert "\x1b" not in shown["text/plain"] and "\x1b" not in shown["text/html"], shown["text/plain"]
    assert "mRED" in shown["text/plain"] and "mRED" in shown["text/html"]


def test_deleting_a_run_that_goes_on_is_refused(runs_folder):
    def waits(ctx):
        while not ctx.should_stop:
            time.sleep(0.01)

    run = ddp_notebook.launch(waits, devices="cpu*2")
    try:
        with pytest.raises(DDPNotebookError, match="is still"):
            run.delete()
    finally:
        run.stop(wait=True)
    run.delete()
    assert not os.path.exists(run.run_dir)


def test_a_git_lookup_still_running_when_its_run_ends_is_ended_with_it(tmp_path, monkeypatch):
    """A git that answers slowly (a huge work tree, a busy machine) is ended with the run's end:
    no process of the lookup outlives its run, and nothing it found later is recorded."""
    import psutil

    from ddp_notebook.lifecycle.provenance import GitLookup

    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "git").write_text("#!/bin/sh\nexec sleep 60\n")
    (fake / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}{os.pathsep}{os.environ['PATH']}")
    (tmp_path / "tree" / ".git").mkdir(parents=True)
    emitted = []
    lookup = GitLookup(str(tmp_path / "tree"), emitted.append)
    deadline = time.monotonic() + 30
    while not (git := [p for p in psutil.Process().children() if p.name() == "sleep"]):
        assert time.monotonic() < deadline, "the lookup's git never started"
        time.sleep(0.02)
    lookup.end(0.1)
    assert all(not p.is_running() for p in git)  # ended and collected
    assert emitted == []
