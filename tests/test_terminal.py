"""Progress outside a notebook: in place on a terminal, a line per change in a log, and a final
table that shows the outcome; a blocking fit() in a script shows it on stderr."""
import io
import os
import re
import subprocess
import sys

import pytest

from ddp_notebook.core.failures import WorkerFailure
from ddp_notebook.core.state import RunState
from ddp_notebook.ui.html import hint_for
from ddp_notebook.ui.terminal import LineProgress, TerminalProgress
from ddp_notebook.ui.text import format_run

HERE = os.path.dirname(__file__)
ROOT = os.path.dirname(HERE)


def state_with(steps):
    s = RunState()
    s.apply({"kind": "run_started", "time": 0.0, "run_id": "r1", "devices": ["cpu:0", "cpu:1"], "backend": "gloo"})
    for r in (0, 1):
        s.apply({"kind": "ready", "time": 0.1, "rank": r})
    for t, step in steps:
        for r in (0, 1):
            s.apply({"kind": "progress", "time": t, "rank": r, "step": step, "total": 100, "metrics": {"loss": 1 / step}})
    return s


@pytest.mark.unit
def test_a_log_gets_a_line_per_change_not_per_report():
    out = io.StringIO()
    lines = LineProgress(out)
    s = state_with([(1.0, 1)])
    lines.update(s, now=1.0)
    for t, step in [(1.1, 2), (1.2, 3), (1.3, 4)]:  # the same tenth of the steps: nothing new to say
        for r in (0, 1):
            s.apply({"kind": "progress", "time": t, "rank": r, "step": step, "total": 100})
        lines.update(s, now=t)
    assert len(out.getvalue().splitlines()) == 2
    for r in (0, 1):
        s.apply({"kind": "progress", "time": 2.0, "rank": r, "step": 12, "total": 100})
    lines.update(s, now=2.0)
    assert len(out.getvalue().splitlines()) == 4 and "step 12/100" in out.getvalue().splitlines()[-1]


@pytest.mark.unit
def test_a_terminal_is_redrawn_in_place_and_ends_on_the_outcome():
    out = io.StringIO()
    view = TerminalProgress(out)
    s = state_with([(1.0, 10), (3.0, 50)])
    view.update(s, now=3.0)
    view.update(s, now=3.5)
    assert out.getvalue().count("\x1b[3F") == 1  # the second drawing went back over the first's 3 lines
    s.apply({"kind": "stopping", "time": 4.0, "reason": "stopped by the user"})
    for r in (0, 1):
        s.apply({"kind": "done", "time": 4.1, "rank": r})
    s.apply({"kind": "run_finished", "time": 4.2, "status": "stopped"})
    view.finish(s)
    last = out.getvalue().split("\x1b[3F")[-1]
    assert "Run r1 stopped after 4.2 s" in last and "running" not in last


@pytest.mark.unit
def test_pace_and_eta_are_shown_while_running():
    s = state_with([(1.0, 10), (3.0, 50)])  # 20 steps/s, 50 to go
    assert s.workers[0].rate == pytest.approx(20.0) and s.workers[0].eta() == pytest.approx(2.5)
    text = format_run(s, now=3.0)
    assert "ETA 2 s on cpu:0,cpu:1" in text.splitlines()[0] and "20 steps/s, ETA 2 s" in text


@pytest.mark.unit
def test_escape_sequences_from_a_run_never_reach_the_terminal():
    evil = "\x1b[2J\x1b[H\x1b]0;pwned\x07"  # clear the screen, retitle the window
    state = RunState()
    state.apply({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0"]})
    state.apply({"kind": "progress", "time": 1.0, "rank": 0, "step": 1, "metrics": {evil + "name": evil + "red"}})
    root = WorkerFailure(rank=0, device="cpu:0", kind="exception", time=2.0, exc_type="ValueError", message=evil + "boom")
    state.apply({"kind": "failure", "time": 2.0, "rank": 0, "failure": root.to_dict()})
    text = format_run(state, now=3.0)
    assert "\x1b" not in text and "\x07" not in text and "name red" in text and "ValueError: boom" in text


@pytest.mark.unit
def test_hints_fit_the_failure():
    one = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="ValueError", message="x")
    assert hint_for(one, ["cpu:0"]) == ("Only worker 1 raised it: retry on cpu:1 alone to reproduce it in one "
                                        "process, or on cpu:0 to go on without it.")
    every = WorkerFailure(rank=0, device="cpu:0", kind="exception", time=0.0, exc_type="KeyError",
                          message="'lr'", same_on=["cpu:0", "cpu:1"])
    assert "retry" not in hint_for(every, []).lower() and "not from a device" in hint_for(every, [])
    # A mistake in the code, on one rank only, or a result that cannot travel: no device advice.
    for code_error in (WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="TypeError",
                                     message="unsupported operand"),
                       WorkerFailure(rank=1, device="cpu:1", kind="result", time=0.0, exc_type="TypeError",
                                     message="cannot pickle '_thread.lock' object")):
        hint = hint_for(code_error, ["cpu:0"])
        assert "cpu:" not in hint and "retry" not in hint.lower() and "not from a device" in hint


SCRIPT = """
import torch, ddp_notebook
x = torch.randn(256, 4); y = x.sum(1, keepdim=True)
result = ddp_notebook.fit(model=torch.nn.Linear(4, 1), train_data=(x, y), loss=torch.nn.MSELoss(),
                          epochs=2, batch_size=32, devices="cpu*2")
print("in sync:", result.ranks_in_sync)
"""


@pytest.mark.processes
def test_a_blocking_fit_in_a_script_shows_progress_on_stderr(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 0, done.stderr
    assert done.stdout == "in sync: True\n"  # stdout stays the program's
    err = done.stderr.splitlines()
    assert any(line.startswith("rank 1 cpu:1") and "running" in line for line in err), done.stderr
    assert any(line.startswith("Run ") and " succeeded after " in line for line in err), done.stderr


@pytest.mark.processes
def test_progress_can_be_turned_off(tmp_path):
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT, "DDP_NOTEBOOK_PROGRESS": "0"})
    assert done.returncode == 0 and done.stdout == "in sync: True\n" and "rank 0" not in done.stderr, done.stderr


@pytest.mark.processes
def test_the_demo_ends_on_a_table_that_shows_a_failure(tmp_path):
    done = subprocess.run([sys.executable, "-m", "ddp_notebook", "demo", "--epochs", "4", "--fail-rank", "1"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ROOT})
    assert done.returncode == 1
    table = done.stdout[done.stdout.rindex("\nRun "):]
    assert " failed after " in table.splitlines()[1] and "worker 1 (cpu:1) failed: ValueError: boom" in table
    assert "WorkerFailedError: Distributed data parallel worker 1 (cpu:1) failed" in done.stderr
    # Epochs are counted from 1 of 4, as the panel counts them: never "epoch 0", never "epoch 4" alone.
    epochs = re.findall(r"epoch (\d+)(/4)?", done.stdout + done.stderr)
    assert epochs and all(1 <= int(n) <= 4 and of == "/4" for n, of in epochs), epochs


SENDS_DATA = """
import numpy as np, ddp_notebook
data = np.ones(300 * 2**20 // 8)
def total(ctx, data):
    return float(data[:10].sum())
print(ddp_notebook.launch(total, devices="cpu*2", args=(data,)).wait())
"""


@pytest.mark.processes
def test_outside_a_terminal_the_data_copy_prints_whole_lines(tmp_path):
    done = subprocess.run([sys.executable, "-c", SENDS_DATA], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "DDP_NOTEBOOK_PROGRESS": "0"})
    assert done.returncode == 0 and done.stdout == "10.0\n", done.stderr
    lines = done.stderr.splitlines()
    assert "\r" not in done.stderr and "\x1b" not in done.stderr
    assert lines[0] == "sending data 0 B/315 MB", lines
    assert lines[1].startswith("data: 315 MB copied to shared memory in "), lines
    assert len(lines) == 2, lines


IGNORES_STOP = """
import time, ddp_notebook
def forever(rank):
    print("training", flush=True) if rank == 1 else None
    while True:
        time.sleep(0.05)
ddp_notebook.spawn(forever, nprocs=2, stop_grace=1.0)
"""


@pytest.mark.processes
def test_after_ctrl_c_the_table_shows_the_run_stopped_not_running(tmp_path):
    import signal

    # (a shell's background job inherits Ctrl-C ignored: the script gets Python's own handling back)
    proc = subprocess.Popen([sys.executable, "-c", IGNORES_STOP], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": ROOT},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []
    for line in proc.stderr:  # progress lines: wait until both ranks run
        seen.append(line)
        if line.startswith("rank 1 cpu:1") and "running" in line:
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) != 0
    table = rest[rest.rindex("\nRun "):] if "\nRun " in rest else rest[rest.index("Run "):]
    assert " stopped after " in table.splitlines()[1 if table.startswith("\n") else 0], rest
    assert "running" not in table, rest
