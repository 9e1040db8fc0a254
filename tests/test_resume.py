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
from ddp_notebook import Run
from ddp_notebook.errors import NoCheckpointError

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
        # The checkpoint as the notebook recorded it, not just its file: on a busy machine the
        # notebook may not have read the event yet when the file is there.
        wait_until(lambda: _logged_checkpoint(run_dir, 1), timeout=120)
        below = _descendants(notebook.pid)
    finally:
        notebook.send_signal(signal.SIGKILL)
        notebook.wait()
    _wait_gone(below)  # the ranks end with their notebook: only then may the held epoch go on (it must not)
    hold.unlink()
    return run_dir


def _logged_checkpoint(run_dir, epoch):
    """Whether the run's log holds the checkpoint of ``epoch`` (read as it is written)."""
    try:
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            return any('"checkpoint"' in line and f'"epoch": {epoch},' in line for line in f)
    except OSError:
        return False


def _descendants(pid):
    import psutil

    return psutil.Process(pid).children(recursive=True)


def _wait_gone(processes):
    """Wait until each process (the fork server, the ranks) has ended, as they must once their
    notebook process is gone; a rank still holding its epoch must not be let go on."""
    import psutil

    def alive(p):
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False
    wait_until(lambda: not any(alive(p) for p in processes), timeout=60)


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


# A kernel's cells: a 2-rank fit (8 steps an epoch, 4 epochs) whose 17th batch waits while the
# file "hold" exists, in the default runs folder the kernel was given.
KERNEL_FIT = textwrap.dedent("""
    import json, os, sys, torch
    sys.path.insert(0, {tests!r})
    import ddp_notebook, models
    %load_ext ddp_notebook
    x, y = models.regression_data()
    run = ddp_notebook.fit(model=models.HeldAfter({hold!r}, after=16), train_data=(x, y), loss=torch.nn.MSELoss(),
                           optimizer=models.sgd(0.05), epochs=4, batch_size=32, devices="cpu*2", wait=False,
                           name="held", tags={{"case": "resume"}})
    print(json.dumps({{"run": run.id, "kernel": os.getpid()}}))
""")
LOADED = textwrap.dedent("""
    loaded = ddp_notebook.Run.load({run!r})
    assert (loaded.name, loaded.tags, loaded.config["epochs"]) == ("held", {{"case": "resume"}}, 4)  # what it was
    assert loaded.metrics["rank0.peak_rss"] > 0 and [r["epoch"] for r in loaded.history][:1] == [0]
    print(json.dumps({{"status": loaded.status, "reason": loaded.state.stop_reason,
                      "notebook_ended": loaded.state.notebook_ended}}))
""")


def _execute(kc, code):
    """Run ``code`` in the kernel; what it printed (an error fails the test)."""
    out = []
    reply = kc.execute_interactive(code, timeout=180, output_hook=lambda m: out.append(
        m["content"].get("text", "") if m["msg_type"] == "stream" else ""))
    assert reply["content"]["status"] == "ok", (reply["content"], out)
    return "".join(out)


def _reached_step(run_dir, step):
    """Whether rank 0 of the run said it reached ``step`` (its log, read as it is written)."""
    try:
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            return any('"progress"' in line and '"rank": 0' in line and f'"step": {step},' in line for line in f)
    except OSError:
        return False


@pytest.mark.kernel
def test_a_run_cut_off_by_a_kernel_death_is_found_with_its_reason_after_the_restart(tmp_path):
    """A real kernel killed mid-run (a crash), then one restarted mid-run (it exits on its own): the
    next kernel lists each run with why it ended, ``%ddp_status`` and ``Run.load`` say it, and
    ``%ddp_retry ID --resume`` goes on from the checkpoint."""
    import json

    import psutil

    from helpers import started_kernel

    root = tmp_path / "runs"
    env = dict(os.environ, DDP_NOTEBOOK_RUNS=str(root), DDP_NOTEBOOK_PROGRESS="0")
    holds = [tmp_path / "hold1", tmp_path / "hold2"]
    for hold in holds:
        hold.touch()
    crash = "the notebook process ended (kernel restart or crash) at step 16 of 32 (epoch 2/4)"
    kernels = []
    try:
        km, kc = started_kernel(env=env)
        kernels.append((km, kc))
        first = json.loads(_execute(kc, KERNEL_FIT.format(tests=TESTS, hold=str(holds[0]))).splitlines()[-1])
        wait_until(lambda: _reached_step(root / first["run"], 16), timeout=180)
        below = _descendants(first["kernel"])
        live = Run.load(root / first["run"])  # read here while that kernel still runs it: not retried twice
        with pytest.raises(ddp_notebook.DDPNotebookError, match=rf"^run {first['run']} is still running in another "
                                                                  r"notebook process: stop it there"):
            live.retry()
        psutil.Process(first["kernel"]).kill()  # a crash: nothing of the kernel runs after this
        wait_until(lambda: not psutil.pid_exists(first["kernel"]) or
                   psutil.Process(first["kernel"]).status() == psutil.STATUS_ZOMBIE, timeout=30)
        _wait_gone(below)  # the ranks end with their kernel, before the held epoch could go on
        holds[0].unlink()

        km, kc = started_kernel(env=env)
        kernels.append((km, kc))
        out = _execute(kc, f"import json, sys, ddp_notebook\nsys.path.insert(0, {TESTS!r})\n%load_ext ddp_notebook\n"
                           "%ddp_runs")
        # the earlier kernel's run, launched from this working directory: listed, with why it ended
        listed = out.strip().splitlines()
        assert listed[0].startswith("Runs launched from ") and ", newest first: 1 run, " in listed[0]
        assert listed[2].startswith(f"  {first['run']}  held  stopped  cpu:0,cpu:1 ") and listed[2].endswith(crash)
        listed = _execute(kc, "%ddp_runs --all").splitlines()
        assert listed[0].startswith(f"Runs in {root}, newest first: 1 run, ")
        assert listed[2].startswith(f"  {first['run']}  held  stopped  cpu:0,cpu:1 ") and listed[2].endswith(crash)
        assert f"  reason: {crash}" in _execute(kc, f"%ddp_status {first['run']}").splitlines()
        loaded = json.loads(_execute(kc, LOADED.format(run=first["run"])).splitlines()[-1])
        assert loaded == {"status": "stopped", "reason": crash, "notebook_ended": True}
        _execute(kc, f"%ddp_retry {first['run']} --resume -d cpu*2")
        resumed = _execute(kc, "print(_ddp_run.wait(timeout=120).resumed_from_epoch)")
        assert resumed.strip().splitlines()[-1] == "1"

        # A restart: the kernel exits on its own, and writes the run's end before its workers go.
        second = json.loads(_execute(kc, KERNEL_FIT.format(tests=TESTS, hold=str(holds[1]))).splitlines()[-1])
        wait_until(lambda: _reached_step(root / second["run"], 16), timeout=180)
        km.restart_kernel(now=False)
        kc.wait_for_ready(timeout=120)
        _execute(kc, f"import json, sys, ddp_notebook\nsys.path.insert(0, {TESTS!r})")
        loaded = json.loads(_execute(kc, LOADED.format(run=second["run"])).splitlines()[-1])
        assert loaded == {"status": "stopped", "notebook_ended": True, "reason": "the notebook process exited "
                          "(kernel restart or shutdown) at step 16 of 32 (epoch 2/4)"}
    finally:
        for km, kc in kernels:
            kc.stop_channels()
            try:
                km.shutdown_kernel(now=True)
            except Exception:  # noqa: BLE001 - the one killed above: only its resources are left to free
                km.cleanup_resources()
