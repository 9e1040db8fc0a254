"""A session in real JupyterLab and headless Chromium: its live view, a %%ddp cell on every rank
(output by rank), a cell that fails on rank 1 (the card and its locals in the view), Kernel → Interrupt while
a cell runs, a rank killed from a cell (the view says the session ended), Re-form clicked
(once), and a cell run without blocking stopped from the view. Screenshots go to $DDP_NOTEBOOK_ARTIFACTS (default artifacts/)."""
import os
import re

import pytest
from playwright.sync_api import expect
from test_browser import ARTIFACTS, KERNEL_READY, lab, open_notebook, run_cell, shot  # noqa: F401 - lab is a fixture

from helpers import wait_until

pytestmark = pytest.mark.browser

NAME = "session.ipynb"
CELLS = [
    "%load_ext ddp_notebook\nimport os, signal, torch\n%ddp_session cpu*2",
    '%%ddp\nx = torch.arange(3.0) + rank\nprint(f"rank {rank} holds {x.tolist()}")',
    '%%ddp\nt = torch.zeros(rank + 2, 3)\nif rank == 1:\n    raise ValueError(f"bad shape {tuple(t.shape)}")',
    "%%ddp\nimport time\nfor i in range(6000):\n    time.sleep(0.01)",
    "pids = _ddp_session.current_run.pids()\nos.kill(pids[1], signal.SIGKILL)\nprint('killed', pids[1])",
    "%%ddp\n'x' in globals(), rank",
    "%%ddp --noblock\nimport time\nfor i in range(6000):\n    time.sleep(0.01)",
    "%ddp_session --stop",
]


def notebook(root):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / NAME))


def test_a_session_in_jupyterlab_cells_failure_card_interrupt_kill_and_re_form(lab, tmp_path):  # noqa: F811
    import psutil

    root = lab[2]
    notebook(root)
    ranks_seen = set()
    with open_notebook(lab, tmp_path, NAME) as page:
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        out = lambda i: cells.nth(i).locator(".jp-OutputArea")  # noqa: E731
        view = page.locator(".ddp-run-view").first  # the session's run's view (a --noblock cell shows another)
        # The session forms: its view, a row per rank, idle.
        run_cell(page, 0, wait=False)
        expect(out(0)).to_contain_text("Session ready: 2 ranks on cpu:0, cpu:1", timeout=120_000)
        expect(page.locator(".ddp-run-view")).to_have_count(1, timeout=60_000)
        expect(view.locator(".ddp-rank")).to_have_count(2)
        expect(view.locator(".ddp-rank-status").nth(1)).to_have_text("idle", timeout=30_000)
        ranks_seen.update(int(v) for v in re.findall(r"pid (\d+)", " ".join(view.locator(".ddp-progress").all_inner_texts())))
        # A cell on every rank: each rank's output, and the outcome in the view.
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        run_cell(page, 1, wait=False)
        expect(out(1)).to_contain_text("[rank 0] rank 0 holds [0.0, 1.0, 2.0]", timeout=60_000)
        expect(out(1)).to_contain_text("[rank 1] rank 1 holds [1.0, 2.0, 3.0]")
        expect(view.locator(".ddp-activity")).to_contain_text("Last: cell 1 on ranks 0, 1: ok in", timeout=30_000)
        expect(view.locator(".ddp-last").nth(1)).to_contain_text("rank 1 holds [1.0, 2.0, 3.0]", timeout=30_000)
        shot(view, "session-cell.png")
        # A cell that fails on rank 1: the error names it; the view shows the card with its locals.
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        run_cell(page, 2, wait=False)
        expect(out(2)).to_contain_text("CellError: cell 2 failed on rank 1 (cpu:1): ValueError: bad shape (3, 3)",
                                       timeout=60_000)
        card = view.locator(".ddp-failure")
        expect(card).to_contain_text("worker 1 (cpu:1) failed: ValueError: bad shape (3, 3)", timeout=30_000)
        expect(card).to_contain_text("Locals in <module>")
        expect(card.locator(".ddp-locals")).to_contain_text("Tensor[3, 3] float32 cpu")
        expect(view.locator(".ddp-rank-status").nth(1)).to_have_text("failed")
        expect(view.locator(".ddp-rank-status").nth(0)).to_have_text("idle")
        shot(view, "session-failed-cell.png")
        # Kernel → Interrupt while a cell runs (the view says so): every rank leaves it, the session goes on.
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        run_cell(page, 3, wait=False)
        expect(view.locator(".ddp-activity")).to_contain_text("Kernel → Interrupt stops it", timeout=60_000)
        expect(view.locator(".ddp-rank-status").nth(0)).to_have_text("running")
        expect(view.locator(".ddp-progress").nth(0)).to_contain_text(re.compile(r"in cell 3 for [1-9]\.\d s"),
                                                                     timeout=30_000)  # the clock ticks
        shot(view, "session-running.png")
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")
        expect(out(3)).to_contain_text("Cell 3 interrupted on ranks 0, 1; the session goes on", timeout=30_000)
        expect(view.locator(".ddp-activity")).to_contain_text("interrupted")
        # The failed cell's card, folded under a line that names it, once another cell has run.
        expect(view.locator(".ddp-last-failure > summary")).to_contain_text(re.compile(
            r"Last failure: cell 2 \(.*\) failed on rank 1"))
        expect(view.locator(".ddp-failure")).to_be_hidden()
        shot(view, "session-interrupted.png")
        # A rank killed from a cell: the view says the session ended and offers Re-form.
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        run_cell(page, 4, wait=False)
        expect(out(4)).to_contain_text("killed", timeout=30_000)
        expect(view.locator(".ddp-rank-status").nth(1)).to_have_text("failed", timeout=60_000)
        expect(view.locator(".ddp-rank-status").nth(0)).to_have_text(re.compile("stopped|knock-on"), timeout=60_000)
        expect(view.locator(".ddp-activity")).to_contain_text("Ended: its ranks are gone")
        expect(view.locator(".ddp-failure")).to_contain_text("killed by signal SIGKILL")
        reform = view.locator(".ddp-reform")
        expect(reform).to_be_visible()
        expect(view).to_contain_text("the ranks' namespaces are lost")
        shot(view, "session-ended.png")
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        reform.dblclick()  # one session formed for a double click
        expect(view.locator(".ddp-reformed")).to_contain_text("namespaces were lost", timeout=120_000)
        formed = out(0).locator(".ddp-run-view").nth(1)  # the new run's view, below the old one's
        expect(formed.locator(".ddp-rank-status").nth(0)).to_have_text("idle", timeout=60_000)
        expect(formed).to_contain_text("formed again after")
        expect(reform).to_be_disabled()
        page.wait_for_function(KERNEL_READY, timeout=60_000)  # both clicks handled by now
        expect(view.locator(".ddp-reformed")).to_have_count(1)
        expect(out(0).locator(".ddp-run-view")).to_have_count(2)
        texts = formed.locator(".ddp-progress").all_inner_texts()
        ranks_seen.update(int(v) for v in re.findall(r"pid (\d+)", " ".join(texts)))
        shot(out(0), "session-re-formed.png")
        # The new ranks run cells, with fresh namespaces.
        run_cell(page, 5, wait=False)
        expect(out(5)).to_contain_text("[rank 1] Out: (False, 1)", timeout=60_000)
        # A cell run without blocking: the kernel is free at once, and Stop in the view interrupts it.
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        run_cell(page, 6, wait=False)
        expect(out(6)).to_contain_text("without blocking", timeout=60_000)
        page.wait_for_function(KERNEL_READY, timeout=60_000)  # the cell has returned; the ranks run it
        stop = out(6).locator(".ddp-stop")
        expect(stop).to_be_visible(timeout=30_000)
        expect(out(6).locator(".ddp-activity")).to_contain_text("Stop or session.interrupt() stops it")
        shot(out(6).locator(".ddp-run-view"), "session-noblock-stop.png")
        stop.click()
        expect(out(6)).to_contain_text(re.compile(r"Cell \d+ interrupted on ranks 0, 1; the session goes on"),
                                       timeout=30_000)
        expect(stop).to_be_hidden()
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        run_cell(page, 7, wait=False)
        expect(out(7)).to_contain_text("Session closed", timeout=60_000)
        expect(formed.locator(".ddp-rank-status").nth(0)).to_have_text("closed", timeout=30_000)
        shot(formed, "session-closed.png")
        page.screenshot(path=os.path.join(ARTIFACTS, "session-jupyterlab.png"), full_page=True)

    def ended(pid):
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    assert len(ranks_seen) == 4, ranks_seen  # two ranks, then two new ones
    wait_until(lambda: all(ended(pid) for pid in ranks_seen), timeout=30)
