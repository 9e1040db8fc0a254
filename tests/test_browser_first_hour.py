"""A newcomer's first hour in real JupyterLab: a function written without ``ctx`` is named before
anything starts; a spinning rank is named by the panel long before any watchdog; a kernel restart
mid-run leaves a run that ``%ddp_runs --all`` finds, with why it ended, and ``%ddp_retry --resume``
goes on from its checkpoint. Screenshots go to $DDP_NOTEBOOK_ARTIFACTS (default artifacts/)."""
import os
import re

import pytest
from playwright.sync_api import expect
from test_browser import ARTIFACTS, KERNEL_READY, lab, open_notebook, run_cell  # noqa: F401 - lab is a fixture

pytestmark = pytest.mark.browser

SETUP = '''%load_ext ddp_notebook
import os, time, torch, torch.distributed as dist, ddp_notebook

def no_ctx(steps):
    return steps

def spins(ctx):
    for step in (1, 2):
        ctx.log(step=step, total=1000)
    if ctx.rank == 1:
        while True:
            pass
    dist.all_reduce(torch.ones(1))

def resumable(ctx, epochs):
    kept = ctx.load_checkpoint()
    start = kept["epoch"] + 1 if kept else 0
    if kept:
        print(f"resumed after epoch {kept['epoch']}")
    for epoch in ctx.epochs(epochs, start=start):
        time.sleep(0.3)
        while epoch == 6 and os.path.exists("hold"):  # the restart comes here, however busy the machine
            time.sleep(0.05)
        ctx.log(loss=1.0 / (epoch + 1))
        ctx.save_checkpoint({"epoch": epoch}, epoch)
    return epochs

open("hold", "w").close()
from ddp_notebook.lifecycle import watchdog
watchdog.NOTE_AFTER = 2.0  # (the test's: a quiet run's notes after 2 s of quiet, not 10)'''
NO_CTX = "%ddp_fit no_ctx --devices cpu*2"
SPIN = '''spin = ddp_notebook.launch(spins, devices="cpu*2", stall_timeout=None)
spin'''
LONG = '''long = ddp_notebook.launch(resumable, devices="cpu*2", args=(20,))
open("long_id.txt", "w").write(long.id)
long'''
AFTER_RESTART = '''%load_ext ddp_notebook
%ddp_runs --all'''
RESUME = '''import os; os.remove("hold")
rid = open("long_id.txt").read()
%ddp_retry $rid --resume -d cpu*2'''
NAME = "first_hour.ipynb"


def notebook(root):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c)
                                         for c in (SETUP, NO_CTX, SPIN, LONG, AFTER_RESTART, RESUME)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / NAME))


def test_no_ctx_a_spinning_rank_and_a_restart_mid_run_in_jupyterlab(lab, tmp_path):  # noqa: F811
    root = lab[2]
    notebook(root)
    with open_notebook(lab, tmp_path, NAME) as page:
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        output = lambda i: cells.nth(i).locator(".jp-OutputArea")  # noqa: E731
        for i in (0, 1, 2, 3):
            run_cell(page, i)
        # 1. A function without ctx: one line that says what to write, before anything starts.
        expect(output(1)).to_contain_text(
            "no_ctx(steps) does not take the worker context: write def no_ctx(ctx, steps)", timeout=120_000)
        expect(output(1)).not_to_contain_text("Traceback")
        # 2. A spinning rank: the panel says who holds the other up, with the true last step.
        spin = output(2)
        # (the cell's lines, named as IPython names the cell)
        expect(spin).to_contain_text(re.compile(r"rank 0 waits in all_reduce \(cell In\[\d+\]:13\) for rank 1"),
                                     timeout=120_000)
        expect(spin).to_contain_text(re.compile(r"rank 1 runs at cell In\[\d+\]:1[12], \d+ % CPU"))  # (while True: pass)
        expect(spin.locator(".ddp-progress").nth(0)).to_contain_text("step 2/1000")
        expect(spin.locator(".ddp-progress").nth(1)).to_contain_text("step 2/1000")
        spin.scroll_into_view_if_needed()
        spin.screenshot(path=os.path.join(ARTIFACTS, "first-hour-spinning-rank.png"))
        # 3. A kernel restart while a run trains and checkpoints.
        long = output(3)
        expect(long).to_contain_text(re.compile(r"epoch [4-7]/20"), timeout=120_000)
        run_id = (root / "long_id.txt").read_text()
        page.evaluate("() => { window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart(); }")
        page.wait_for_function(KERNEL_READY, timeout=120_000)
        run_cell(page, 4)
        listing = output(4)
        expect(listing).to_contain_text(run_id, timeout=120_000)
        # (Kernel -> Restart shuts the kernel down: the notebook process said so as it exited.)
        expect(listing).to_contain_text(re.compile(
            rf"{run_id}\s+stopped .* the notebook process exited \(kernel restart or shutdown\) at epoch "
            r"[5-7]/20"))
        listing.scroll_into_view_if_needed()
        listing.screenshot(path=os.path.join(ARTIFACTS, "first-hour-runs-all.png"))
        run_cell(page, 5)
        resumed = output(5)
        expect(resumed).to_contain_text("succeeded", timeout=120_000)
        resumed.get_by_text("Output per device").first.click()
        expect(resumed).to_contain_text(re.compile(r"resumed after epoch ([3-9]|\d\d)"))
        resumed.scroll_into_view_if_needed()
        resumed.screenshot(path=os.path.join(ARTIFACTS, "first-hour-resumed.png"))
