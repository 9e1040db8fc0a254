"""The runs folder on disk (#25 items 3 and 4): how a run whose notebook process went away reads
back (``lifecycle.stored``), checkpoints kept to the last few and the best (``core.rundir``), and
the runs folder kept within its bounds, by count and by size, oldest finished runs first, never a
run still going nor one a live run reads."""
from __future__ import annotations

import gc
import json
import os

import pytest
from IPython.core.error import UsageError

from ddp_notebook.core.errors import DDPNotebookError, LaunchOptionError
from ddp_notebook.core.rundir import RunDir, folder_bytes, runs_limits
from ddp_notebook.lifecycle.options import RunSettings
from ddp_notebook.lifecycle.run import Run
from ddp_notebook.lifecycle.stored import (
    Notebook,
    keep_folder_bounded,
    note_start,
    notebook_of,
    prune_folder,
    read_run,
    read_summary,
    stored_runs,
)
from ddp_notebook.ui.text import format_run, format_runs


def _write_log(directory: RunDir, finished: bool = True, step: int = 31, total: int = 400) -> None:
    """The log of a two-rank run that reached ``step`` of ``total``, ended or not."""
    with directory.open_log() as log:
        def emit(**event):
            log.write(json.dumps(event) + "\n")
        emit(kind="run_started", time=100.0, run_id=directory.id, devices=["cpu:0", "cpu:1"], backend="gloo")
        for rank in (0, 1):
            emit(kind="started", time=100.5, rank=rank, pid=10**6 + rank)
            emit(kind="ready", time=101.0, rank=rank)
        for s in range(1, step + 1):
            for rank in (0, 1):
                emit(kind="progress", time=101.0 + s, rank=rank, step=s, total=total, metrics={"loss": 1.0 / s})
        if finished:
            for rank in (0, 1):
                emit(kind="done", time=200.0, rank=rank)
                emit(kind="exited", time=200.0, rank=rank, exit_code=0)
            emit(kind="run_finished", time=200.0, status="succeeded")


def _set_notebook(directory: RunDir, **changes) -> None:
    """Rewrite the run's record of its notebook process (``started=0.0``: its pid now names
    another process, as after the notebook died and the pid was used again)."""
    record = json.loads(directory.read_private(RunDir.NOTEBOOK))
    directory.remove(RunDir.NOTEBOOK)
    directory.write_private(RunDir.NOTEBOOK, json.dumps({**record, **changes}).encode())


# ---- a run whose notebook process went away -------------------------------------------------------

def test_a_log_without_its_end_is_running_while_its_notebook_lives_and_cut_off_once_it_is_gone(tmp_path, monkeypatch,
                                                                                              ipython_shell):
    directory = RunDir.create(str(tmp_path))
    note_start(directory, RunSettings())
    _write_log(directory, finished=False)
    assert notebook_of(directory) == Notebook.ALIVE  # this process runs it
    assert read_run(directory.path).stream.state.status == "running"  # what the log says is true now

    read_back = Run.load(directory.path)  # while "another" notebook process runs it: only that one can stop it
    with pytest.raises(DDPNotebookError, match=rf"^run {directory.id} is running in another notebook process, which "
                                               rf"alone can stop it: run.stop\(\) or %ddp_stop {directory.id} there$"):
        read_back.stop()
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", str(tmp_path))  # (it said "has already ended (running)")
    ipython_shell.run_line_magic("load_ext", "ddp_notebook")
    with pytest.raises(UsageError, match=rf"^%ddp_stop: run {directory.id} is running in another notebook process"):
        ipython_shell.run_line_magic("ddp_stop", directory.id)

    _set_notebook(directory, started=0.0)  # the notebook died; its pid is another process's now
    assert notebook_of(directory) == Notebook.GONE
    reason = "the notebook process ended (kernel restart or crash) at step 31 of 400"
    for state in (read_run(directory.path).stream.state, read_summary(directory)):
        assert state.status == "stopped" and state.notebook_ended and state.stop_reason == reason
        assert [w.status for w in state.workers.values()] == ["stopped", "stopped"]
        assert state.ended_at == 101.0 + 31  # when the run was last heard of
    state = read_summary(directory)
    assert f"  reason: {reason}" in format_run(state).splitlines()
    row = format_runs([state])[1]
    assert row.startswith(f"  {directory.id}  stopped ") and row.endswith(reason)


def test_a_run_whose_notebook_runs_on_another_host_is_not_taken_as_ended(tmp_path):
    directory = RunDir.create(str(tmp_path))
    note_start(directory, RunSettings())
    _write_log(directory, finished=False)
    _set_notebook(directory, host="another-host", started=0.0)
    assert notebook_of(directory) == Notebook.UNKNOWN
    assert read_summary(directory).status == "running"
    assert prune_folder(str(tmp_path), keep=0) == []  # never removed while it may go on


def test_a_log_of_an_earlier_version_without_a_record_still_reads_back_as_cut_off(tmp_path):
    directory = RunDir.create(str(tmp_path))
    _write_log(directory, finished=False, step=3, total=0)
    state = read_run(directory.path).stream.state
    assert state.status == "stopped" and state.stop_reason == ("the notebook process ended (kernel restart or "
                                                               "crash) at step 3")


# ---- checkpoints ----------------------------------------------------------------------------------

def test_checkpoints_keep_the_last_ones_the_latest_and_the_best(tmp_path):
    directory = RunDir(str(tmp_path / "run"))
    os.mkdir(directory.path)
    for epoch in range(6):
        directory.save_checkpoint(epoch, lambda f: f.write(b"x" * 100), keep=2, best=epoch == 1)
    assert [os.path.basename(p) for p in directory.checkpoints()] == ["epoch-0001.pt", "epoch-0004.pt",
                                                                      "epoch-0005.pt"]
    assert directory.latest_checkpoint() == directory.checkpoint_path(5)
    assert directory.best_checkpoint() == directory.checkpoint_path(1)
    directory.save_checkpoint(6, lambda f: f.write(b"y"), keep=2, best=True)  # a better one: the old best goes
    assert [os.path.basename(p) for p in directory.checkpoints()] == ["epoch-0005.pt", "epoch-0006.pt"]
    for epoch in range(7, 10):
        directory.save_checkpoint(epoch, lambda f: f.write(b"z"))  # keep=None: every one
    assert len(directory.checkpoints()) == 5


# ---- the runs folder's bounds ----------------------------------------------------------------------

def test_the_limits_come_from_the_environment_and_bad_values_are_named(monkeypatch):
    monkeypatch.delenv("DDP_NOTEBOOK_KEEP_RUNS", raising=False)
    monkeypatch.delenv("DDP_NOTEBOOK_RUNS_MAX_BYTES", raising=False)
    assert runs_limits() == (50, 2 * 10**9)
    for keep, size, expected in (("10", "500MB", (10, 500 * 10**6)), ("off", "1GiB", (None, 2**30)),
                                 (" 3 ", "12345", (3, 12345)), ("1", "OFF", (1, None))):
        monkeypatch.setenv("DDP_NOTEBOOK_KEEP_RUNS", keep)
        monkeypatch.setenv("DDP_NOTEBOOK_RUNS_MAX_BYTES", size)
        assert runs_limits() == expected
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS_MAX_BYTES", "1 GB")
    for bad in ("0", "-1", "ten", "1.5", "٣"):
        monkeypatch.setenv("DDP_NOTEBOOK_KEEP_RUNS", bad)
        with pytest.raises(LaunchOptionError, match=rf"\$DDP_NOTEBOOK_KEEP_RUNS must be a whole number of runs >= 1, "
                                                    rf"or off for no bound; not '{bad}'"):
            runs_limits()
    monkeypatch.setenv("DDP_NOTEBOOK_KEEP_RUNS", "5")
    for bad in ("2 parsecs", "0", "-5MB", "lots"):
        monkeypatch.setenv("DDP_NOTEBOOK_RUNS_MAX_BYTES", bad)
        with pytest.raises(LaunchOptionError, match=rf"RUNS_MAX_BYTES must be a number of bytes >= 1.*not '{bad}'"):
            runs_limits()


def test_prune_runs_names_a_bad_argument(tmp_path):
    for keep in (-1, 1.5, True, "3"):
        with pytest.raises(LaunchOptionError, match=rf"keep must be a whole number >= 0 or None .*not {keep!r}"):
            prune_folder(str(tmp_path), keep=keep)
    with pytest.raises(LaunchOptionError, match="max_bytes must be a whole number >= 0"):
        prune_folder(str(tmp_path), max_bytes=-1)


def test_two_hundred_runs_leave_the_folder_within_its_bounds(tmp_path, monkeypatch):
    """200 runs started through the real path of a start (``RunDir.create``, ``note_start``, then
    ``keep_folder_bounded``, which prunes), each writing a log and a checkpoint; among them a run that goes on (its notebook
    lives), the old finished run it resumes from, and a folder that is not a run."""
    root = str(tmp_path / "runs")
    monkeypatch.setenv("DDP_NOTEBOOK_KEEP_RUNS", "40")
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS_MAX_BYTES", "600kB")
    os.makedirs(os.path.join(root, "my-notes"))  # not a run: never removed
    with open(os.path.join(root, "my-notes", "big.bin"), "wb") as f:
        f.write(b"n" * 1000)

    def start(reads=None, finished=True):
        directory = RunDir.create(root)
        note_start(directory, RunSettings(resume_from=reads))
        keep_folder_bounded(directory)
        _write_log(directory, finished=finished, step=5)
        directory.save_checkpoint(0, lambda f: f.write(b"w" * 20_000), keep=1)
        return directory

    source = start()  # an old finished run ...
    live = start(reads=source.latest_checkpoint(), finished=False)  # ... that a run still going resumes from
    cut_off = start(finished=False)
    _set_notebook(cut_off, started=0.0)  # a run whose notebook died: ended, so it may go
    made = [source, live, cut_off] + [start() for _ in range(197)]
    left = stored_runs(root)
    assert len(left) <= 40
    assert folder_bytes(root) - 1000 <= 600_000 + folder_bytes(made[-1].path)  # the newest grew after its start
    kept = {d.id for d in left}
    assert {source.id, live.id, made[-1].id} <= kept and cut_off.id not in kept
    assert os.path.exists(os.path.join(root, "my-notes", "big.bin"))
    # oldest finished first (ids say the second a run started)
    removed = [d for d in made if d.id not in kept]
    assert max(d.id[:15] for d in removed) <= min(d.id[:15] for d in left if d.id not in (source.id, live.id))
    # pruned now, to the limits given: still never the live run nor what it reads
    gone = prune_folder(root, keep=0, max_bytes=0)
    assert {os.path.basename(r.path) for r in gone} == kept - {source.id, live.id}
    assert all(r.size > 20_000 for r in gone)
    assert {d.id for d in stored_runs(root)} == {source.id, live.id}


@pytest.mark.processes
def test_real_runs_prune_the_folder_but_keep_the_run_a_fit_resumes_from(tmp_path, monkeypatch):
    import torch

    import ddp_notebook

    import models

    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("DDP_NOTEBOOK_KEEP_RUNS", "1")
    x, y = models.regression_data()
    kw = dict(model=models.linear, train_data=(x, y), loss=torch.nn.MSELoss(), optimizer=models.sgd(0.05),
              batch_size=64, devices="cpu:0", preflight=False)
    first = ddp_notebook.fit(epochs=2, **kw)
    source = first.run.id
    del first
    for _ in range(3):  # this process holds its last 3 runs: the first one is no longer held
        ddp_notebook.launch(_nothing, devices="cpu:0").wait(timeout=120)
    gc.collect()
    assert source not in {r.id for r in ddp_notebook.runs()}  # no longer held here ...
    assert source in {d.id for d in stored_runs()}  # ... but still on disk (it was held at the last start)
    resumed = ddp_notebook.fit(epochs=3, resume_from=source, **kw)  # pruning at its start spares what it reads
    assert resumed.resumed_from_epoch == 1 and [h["epoch"] for h in resumed.history] == [0, 1, 2]
    assert {d.id for d in stored_runs()} >= {source, resumed.run.id}
    ddp_notebook.launch(_nothing, devices="cpu:0").wait(timeout=120)
    assert source not in {d.id for d in stored_runs()}  # once nothing reads it, it goes
    # ddp_notebook.prune_runs, as %ddp_runs --clean: never a run this kernel holds (a retry may read it)
    here = {d.id for d in stored_runs()}
    held = {r.id for r in ddp_notebook.runs()} & here  # (this process holds earlier tests' runs too, elsewhere)
    removed = {os.path.basename(r.path) for r in ddp_notebook.prune_runs(keep=0, max_bytes=0)}
    assert len(held) >= 3 and not removed & held, (held, removed)
    assert {d.id for d in stored_runs()} == held


def _nothing(ctx):
    return None
