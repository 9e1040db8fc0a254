"""A comparison in a real kernel, as a notebook shows it: displayed with a display id, redrawn in
place while a run trains, and ending on the runs' outcome before ``wait()`` returns, also in a
notebook executed without a front end (nbclient)."""
import nbformat
import pytest
from nbclient import NotebookClient

pytestmark = pytest.mark.kernel

SETUP = '''
import os, time, ddp_notebook
def train(ctx, marker, lr):
    step = 0
    while True:
        step += 1
        ctx.log(step=step, loss=lr / step)
        if os.path.exists(marker) or step >= 20000:
            return step
        time.sleep(0.01)
'''


def _iopub(kc, until, timeout=60):
    """Every iopub message until ``until(messages)`` holds (or the deadline)."""
    import queue
    import time

    messages, deadline = [], time.monotonic() + timeout
    while not until(messages):
        assert time.monotonic() < deadline, [m["msg_type"] for m in messages]
        try:
            messages.append(kc.get_iopub_msg(timeout=1))
        except queue.Empty:
            pass
    return messages


def test_a_comparison_of_a_live_run_updates_in_place_and_ends_on_the_outcome(tmp_path):
    from helpers import started_kernel

    marker = str(tmp_path / "go")
    km, kc = started_kernel()
    try:
        kc.execute_interactive(SETUP, timeout=60)
        kc.execute_interactive(f"done = ddp_notebook.launch(train, devices='cpu*2', args=({marker!r} + 'x', 0.1), "
                               f"name='finished'); open({marker!r} + 'x', 'w').close(); done.wait(120)\n"
                               f"live = ddp_notebook.launch(train, devices='cpu*2', args=({marker!r}, 0.01), "
                               "name='training')", timeout=120)
        msg_id = kc.execute("ddp_notebook.compare(done, live)")
        shown = _iopub(kc, lambda ms: any(m["msg_type"] == "display_data" for m in ms))
        first = next(m for m in shown if m["msg_type"] == "display_data")
        display_id = first["content"]["transient"]["display_id"]
        assert "training" in first["content"]["data"]["text/plain"] and "<img" in first["content"]["data"]["text/html"]
        # redrawn in place while it trains (the cell has long returned)
        updates = _iopub(kc, lambda ms: any(m["msg_type"] == "update_display_data" for m in ms))
        update = next(m for m in updates if m["msg_type"] == "update_display_data")
        assert update["content"]["transient"]["display_id"] == display_id
        assert update["parent_header"]["msg_id"] == msg_id  # in the cell that showed it
        open(marker, "w").close()
        wait_id = kc.execute("live.wait(120)")
        # the end is drawn before wait() returns: the last update comes before the wait's idle
        after = _iopub(kc, lambda ms: any(m["msg_type"] == "status" and m["content"]["execution_state"] == "idle"
                                          and m["parent_header"].get("msg_id") == wait_id for m in ms))
        finals = [m for m in updates + after if m["msg_type"] == "update_display_data"]
        text = finals[-1]["content"]["data"]["text/plain"]
        assert text.count("succeeded") == 2 and "running" not in text, text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_a_notebook_run_without_a_front_end_keeps_the_final_comparison(tmp_path):
    marker = str(tmp_path / "go")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(SETUP),
        nbformat.v4.new_code_cell(f"run = ddp_notebook.launch(train, devices='cpu*2', args=({marker!r}, 0.1), "
                                  "name='only')\nddp_notebook.compare(run)"),
        nbformat.v4.new_code_cell(f"open({marker!r}, 'w').close()\nrun.wait(120)"),
    ])
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    [shown] = [o for o in nb.cells[1].outputs if o.get("output_type") == "display_data"]
    assert "succeeded" in shown["data"]["text/plain"] and "running" not in shown["data"]["text/plain"]
