"""A fit cut off by the death of its notebook process goes on from its last checkpoint, through
``Run.load(...).retry(resume=True)`` and ``fit(resume_from=...)`` (lifecycle.resume)."""
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import ddp_notebook
from ddp_notebook import NoCheckpointError, Run

import models
from helpers import wait_until

pytestmark = pytest.mark.processes

TESTS = os.path.dirname(os.path.abspath(__file__))

# The notebook process: a 2-rank fit whose 3rd epoch waits while the file "hold" exists.
NOTEBOOK = textwrap.dedent("""
    import sys, time, torch
    sys.path.insert(0, {tests!r})
    import ddp_notebook, models
    x, y = models.regression_data()
    run = ddp_notebook.fit(model=models.HeldAfter({hold!r}, after=16), train_data=(x, y), loss=torch.nn.MSELoss(),
                           optimizer=models.sgd(0.05), epochs=4, batch_size=32, devices="cpu*2",
                           run_root={root!r}, wait=False)
    print(run.run_dir, flush=True)
    time.sleep(600)
""")


@pytest.fixture
def cut_off_fit(tmp_path):
    """The directory of a fit whose notebook process was killed (SIGKILL) in epoch 2, after the
    checkpoints of epochs 0 and 1."""
    hold = tmp_path / "hold"
    hold.touch()
    root = tmp_path / "runs"
    script = NOTEBOOK.format(tests=TESTS, hold=str(hold), root=str(root))
    notebook = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                env=dict(os.environ, DDP_NOTEBOOK_PROGRESS="0"))
    try:
        run_dir = notebook.stdout.readline().strip()
        assert run_dir, "the notebook process did not start its fit"
        wait_until(lambda: os.path.exists(os.path.join(run_dir, "checkpoints", "epoch-0001.pt")), timeout=120)
    finally:
        notebook.send_signal(signal.SIGKILL)
        notebook.wait()
    hold.unlink()
    return run_dir


def test_a_fit_cut_off_by_its_notebooks_death_resumes_from_its_checkpoint(cut_off_fit, tmp_path):
    loaded = Run.load(cut_off_fit)
    assert loaded.status == "stopped" and "notebook process" in loaded.state.stop_reason
    assert [e["epoch"] for e in loaded.events if e["kind"] == "checkpoint"] == [0, 1]
    # The same call again, on the same devices, from the checkpoint of epoch 1.
    again = loaded.retry(resume=True, devices=loaded.devices)
    result = again.wait(timeout=120)
    assert result.resumed_from_epoch == 1 and [h["epoch"] for h in result.history] == [0, 1, 2, 3]
    assert result.ranks_in_sync and [str(d) for d in again.devices] == ["cpu:0", "cpu:1"]
    # A new fit call, from the run's directory: the weights, optimizer and history of epoch 1.
    x, y = models.regression_data()
    fit = ddp_notebook.fit(model=models.HeldAfter(str(tmp_path / "none"), after=0), train_data=(x, y),
                           loss=torch.nn.MSELoss(), optimizer=models.sgd(0.05), epochs=4, batch_size=32,
                           devices="cpu:0", resume_from=cut_off_fit)
    assert fit.resumed_from_epoch == 1 and [h["epoch"] for h in fit.history] == [0, 1, 2, 3]
    assert fit.history[:2] == result.history[:2]


def test_a_cut_off_fit_resumes_from_the_magics_after_a_restart(cut_off_fit, ipython_shell, monkeypatch, capsys):
    from ddp_notebook.ui.magics import DDPMagics

    ipython_shell.register_magics(DDPMagics)
    monkeypatch.setenv("DDP_NOTEBOOK_RUNS", os.path.dirname(cut_off_fit))  # the default runs folder of the kernel
    tail = os.path.basename(cut_off_fit)[-6:]  # a run of an earlier kernel, named by the end of its id
    ipython_shell.run_line_magic("ddp_status", tail)
    assert "stopped" in capsys.readouterr().out
    ipython_shell.run_line_magic("ddp_retry", f"{tail} --resume -d cpu*2")
    result = ipython_shell.user_ns["_ddp_run"].wait(timeout=120)
    assert result.resumed_from_epoch == 1 and [h["epoch"] for h in result.history] == [0, 1, 2, 3]


def test_resume_from_names_what_it_looked_at(tmp_path):
    x, y = models.regression_data()
    kw = dict(model=models.linear, train_data=(x, y), loss=torch.nn.MSELoss(), devices="cpu:0")
    with pytest.raises(NoCheckpointError, match=f"no checkpoint to resume from in '{tmp_path}'"):
        ddp_notebook.fit(resume_from=str(tmp_path), **kw)
    with pytest.raises(NoCheckpointError, match="resume_from must be a run, .* not int"):
        ddp_notebook.fit(resume_from=3, **kw)
