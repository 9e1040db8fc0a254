"""Functions defined in a notebook's ``__main__``: in an IPython shell and in a real kernel."""
import os
import re

import pytest
from IPython.utils.capture import capture_output

import ddp_notebook
from ddp_notebook.ui.html import failure_card_html

pytestmark = pytest.mark.kernel

CELL_DEFINE = '''
import ddp_notebook, torch, torch.distributed as dist
factor = 5
def train(ctx, steps):
    t = torch.ones(1) * (ctx.rank + 1)
    for step in range(1, steps + 1):
        dist.all_reduce(t)
        ctx.log(step=step, total=steps)
        if ctx.rank == 1 and steps == 99:
            raise ValueError(f"boom at step {step}")
    return t.item() * factor
'''


@pytest.fixture(scope="module")
def ip(ipython_shell):
    return ipython_shell


def test_cell_function_runs_on_two_workers(ip):
    assert ip.run_cell(CELL_DEFINE).success
    assert ip.user_ns["train"].__module__ == "__main__"
    assert ip.run_cell("result = ddp_notebook.launch(train, devices='cpu*2', args=(2,)).wait(timeout=60)").success
    assert ip.user_ns["result"] == 30.0  # 1 + 2 = 3, doubled by the second all_reduce, times factor


def test_failure_shows_the_workers_traceback_with_cell_source(ip):
    assert ip.run_cell(CELL_DEFINE).success
    with capture_output() as out:
        result = ip.run_cell("ddp_notebook.launch(train, devices='cpu*2', args=(99,)).wait(timeout=60)")
    assert not result.success
    text = out.stdout + out.stderr
    assert 'raise ValueError(f"boom at step {step}")' in text  # the cell's line, from the worker
    assert "Traceback from worker 1 (cpu:1)" in text
    assert "Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom at step 1" in text
    assert "supervisor" not in text and "_outcome" not in text  # not the notebook side's frames


def test_a_mistake_in_a_call_shows_the_users_frames_only(ip):
    assert ip.run_cell(CELL_DEFINE).success
    with capture_output() as out:
        result = ip.run_cell("def start():\n    return ddp_notebook.launch(train, devices='cuda:0', args=(1,))\nstart()")
    assert not result.success and isinstance(result.error_in_exec, ddp_notebook.InvalidDevicesError)
    text = out.stdout + out.stderr
    assert "return ddp_notebook.launch(train, devices='cuda:0', args=(1,))" in text  # the user's call
    assert "cpu*2 runs on this machine's CPU" in text  # and what would run here
    assert "ddp_notebook/" not in text and "interactiveshell" not in text  # no library frame
    assert text.count("InvalidDevicesError") == 2  # the header and the last line, once each


def test_a_workers_traceback_shows_the_users_frames_only(ip):
    cell = (
        "import torch\n"
        "def bad_metric(out, y):\n"
        "    return out.sum() + 'x'\n"
        "x = torch.randn(64, 4); y = x.sum(1, keepdim=True)\n"
        "ddp_notebook.fit(torch.nn.Linear(4, 1), (x, y), torch.nn.MSELoss(), valid_data=(x, y),\n"
        "                 metrics={'bad': bad_metric}, devices='cpu*2', preflight=False)\n")
    with capture_output():
        result = ip.run_cell(cell)
    assert not result.success
    failure = result.error_in_exec.failure
    assert failure.exc_type == "TypeError" and "return out.sum() + 'x'" in failure.traceback
    assert "ddp_notebook" not in failure.traceback  # fit's loop around the user's metric: left out
    assert "not from a device" in failure_card_html(failure, result.error_in_exec.failures, ["cpu:0"])


def test_real_kernel_runs_a_cell_defined_function():
    from helpers import started_kernel

    km, kc = started_kernel()  # inherits DDP_NOTEBOOK_RUNS from conftest
    try:
        outputs = []

        def hook(msg):
            if msg["msg_type"] in ("stream", "execute_result", "error"):
                outputs.append(msg["content"])

        reply = kc.execute_interactive(CELL_DEFINE, timeout=120, output_hook=hook)
        assert reply["content"]["status"] == "ok", outputs
        reply = kc.execute_interactive("print(ddp_notebook.launch(train, devices='cpu:0,cpu:1', args=(3,)).wait(60))",
                                       timeout=120, output_hook=hook)
        assert reply["content"]["status"] == "ok", outputs
        assert any(o.get("text") == "60.0\n" for o in outputs), outputs
        outputs.clear()
        reply = kc.execute_interactive("run = ddp_notebook.launch(train, devices='cpu*2', args=(1,)); run.wait(60); run",
                                       timeout=120, output_hook=lambda m: outputs.append(m))
        shown = [m["content"]["data"] for m in outputs if m["msg_type"] == "display_data"]
        assert shown and "application/vnd.jupyter.widget-view+json" in shown[0]  # the live panel
        assert "succeeded" in shown[0]["text/plain"] and "rank 1 cpu:1" in shown[0]["text/plain"]
        reply = kc.execute_interactive("ddp_notebook.launch(train, devices='cpu:0,cpu:1', args=(99,)).wait(60)",
                                       timeout=120, output_hook=hook)
        err = reply["content"]
        assert err["status"] == "error" and err["ename"] == "WorkerFailedError"
        tb = "\n".join(err["traceback"])
        assert 'raise ValueError(f"boom at step {step}")' in tb
        assert tb.rstrip().endswith("Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom at step 1")
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


LONG_RUN = '''
import os, time, ddp_notebook
def long_train(ctx, marker):
    step = 0
    while not ctx.should_stop:
        step += 1
        ctx.log(step=step)
        if ctx.rank == 1 and step == 1:
            open(marker, "w").close()
        time.sleep(0.05)
    return step
'''


def strip_ansi(text):
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def test_an_interrupt_during_a_blocking_wait_stops_the_run(tmp_path):
    from helpers import started_kernel, wait_until

    marker = str(tmp_path / "training")
    km, kc = started_kernel()
    try:
        assert kc.execute_interactive(LONG_RUN, timeout=120)["content"]["status"] == "ok"
        outputs = []
        msg_id = kc.execute(f"run = ddp_notebook.launch(long_train, devices='cpu*2', args=({marker!r},))\n"
                            "run.wait()")
        wait_until(lambda: os.path.exists(marker), timeout=120)  # both ranks are training
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=120)
        while reply["parent_header"].get("msg_id") != msg_id:
            reply = kc.get_shell_msg(timeout=120)
        while True:  # what the cell printed before it ended
            msg = kc.get_iopub_msg(timeout=120)
            if msg["msg_type"] == "stream":
                outputs.append(msg["content"]["text"])
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        # One line says what happened, once the run has stopped; no traceback through threading.py.
        content = reply["content"]
        assert content["status"] == "error" and content["ename"] == "RunInterrupted", content
        assert [strip_ansi(line) for line in content["traceback"]] == [
            f"Run {content['evalue'].split()[1]} stopped: interrupted in the notebook"], content
        assert not any("Traceback" in text or "threading" in text for text in outputs), outputs
        done = kc.execute_interactive("run.stop(wait=True); print(run.status, run.state.stop_reason)", timeout=120,
                                      output_hook=lambda m: outputs.append(m["content"].get("text", "")))
        assert done["content"]["status"] == "ok" and "stopped interrupted in the notebook\n" in outputs
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


NOTEBOOK_PATH = '''
import time, ddp_notebook, torch, torch.distributed as dist
def hangs_on_rank_1(ctx):          # never calls ctx.log
    if ctx.rank == 1:
        time.sleep(3600)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()

def wrong_key(ctx, config):        # every rank makes the same mistake
    return config["learning_rate"]

def quick(rank, steps):            # a torch.multiprocessing.spawn-style function
    return rank
'''


def test_in_a_kernel_a_hang_is_named_by_default_a_shared_error_is_said_once_and_blocking_calls_show(tmp_path):
    from helpers import started_kernel

    # The auto watchdog's floor, 300 s for users, lowered for the test.
    km, kc = started_kernel(env={**os.environ, "DDP_NOTEBOOK_STALL_FLOOR": "3"})
    try:
        assert kc.execute_interactive(NOTEBOOK_PATH, timeout=120)["content"]["status"] == "ok"
        reply = kc.execute_interactive("ddp_notebook.launch(hangs_on_rank_1, devices='cpu*2').wait(120)", timeout=180)
        err = reply["content"]
        assert err["status"] == "error" and err["ename"] == "WorkerFailedError", err
        assert err["evalue"].startswith("Distributed data parallel worker 1 (cpu:1) failed: stalled: no progress for ")
        assert "time.sleep(3600)" in "\n".join(err["traceback"])
        reply = kc.execute_interactive("ddp_notebook.launch(wrong_key, devices='cpu*2', args=({},)).wait(120)",
                                       timeout=180)
        assert reply["content"]["evalue"] == ("Every distributed data parallel worker (cpu:0, cpu:1) failed the same "
                                              "way: KeyError: 'learning_rate'")
        shown = []
        reply = kc.execute_interactive("print(ddp_notebook.spawn(quick, args=(3,), nprocs=2))", timeout=180,
                                       output_hook=lambda m: shown.append(m))
        assert reply["content"]["status"] == "ok"
        panels = [m["content"]["data"] for m in shown if m["msg_type"] == "display_data"]
        assert panels and "application/vnd.jupyter.widget-view+json" in panels[0]  # the live panel while it ran
        assert any(m["msg_type"] == "stream" and m["content"]["text"] == "0\n" for m in shown)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
