"""The panel in real JupyterLab at 1400 px: a fit with validation and a metric (rows that fit, the
epoch table and plot), a failing launch whose Retry is double-clicked (one retry), the fallback
of the displays kept current in the saved notebook, and a panel left by a kernel restart that says
it is no longer updated. Screenshots go to $DDP_NOTEBOOK_ARTIFACTS (default artifacts/)."""
import json
import os
import re
import time

import pytest
from playwright.sync_api import expect
from test_browser import ARTIFACTS, KERNEL_READY, lab, open_notebook, shot  # noqa: F401 - lab is a fixture

pytestmark = pytest.mark.browser

SETUP = '''import time, warnings, torch, ddp_notebook
torch.manual_seed(0)
x = torch.randn(600, 8)
y = (x[:, :4].sum(1) > 0).long()

def model():
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))

def acc(out, target):
    return (out.argmax(1) == target).float().mean()

def train(ctx, steps=40):
    for step in range(1, steps + 1):
        print(f"step {step} of {steps}", flush=True)
        if step == 3:
            warnings.warn("this API is old and will go away", FutureWarning)
        ctx.log(step=step, total=steps, loss=1.0 / step)
        if ctx.rank == 1 and step == 5:
            raise ValueError("boom at step 5")
        time.sleep(0.05)
    return steps

def long_train(ctx):
    step = 0
    while not ctx.should_stop:
        step += 1
        ctx.log(step=step, total=100000, loss=1.0 / step)
        time.sleep(0.05)
    return step'''
FIT = '''result = ddp_notebook.fit(model=model, train_data=(x[:480], y[:480]), valid_data=(x[480:], y[480:]),
                          loss=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                          metrics={"acc": acc, "accuracy_of_the_held_out_validation_split_per_epoch": acc}, epochs=6, batch_size=16, devices="cpu*2")
result'''
FAIL = '''run = ddp_notebook.launch(train, devices="cpu:0,cpu:1")
run'''
LONG = '''long = ddp_notebook.launch(long_train, devices="cpu:0")
long'''
NAME = "panel.ipynb"

# Text cut by its column (an ellipsis shown): in the rows' progress and metrics columns, and titles.
CUT = """() => [...document.querySelectorAll(
    '.ddp-run-view .ddp-progress div, .ddp-run-view .ddp-detail div')]
  .filter(d => d.scrollWidth > d.clientWidth + 1).map(d => d.textContent)"""
# Row text that reaches past the panel's right edge (shown nowhere, cut without an ellipsis).
PAST_EDGE = """() => [...document.querySelectorAll('.ddp-run-view .ddp-detail, .ddp-run-view .ddp-detail div')]
  .filter(d => d.getBoundingClientRect().right > d.closest('.ddp-run-view').getBoundingClientRect().right + 1
               || d.scrollWidth > d.clientWidth + 1).map(d => d.textContent)"""
# A view's title drawn under its Stop button, or past the view's right edge.
TITLE_OVER = """() => [...document.querySelectorAll('.ddp-run-view')].flatMap(v => {
  const title = v.querySelector('.widget-html'), stop = v.querySelector('.jupyter-button');  // the header's first two
  const text = title.querySelector('.widget-html-content > div') || title, right = text.getBoundingClientRect().right;
  const clips = getComputedStyle(title).overflowX !== 'visible';  // what overflows a clipping box is not drawn
  const shownRight = clips ? Math.min(right, title.getBoundingClientRect().right) : right;
  const under = stop && stop.offsetParent !== null && shownRight > stop.getBoundingClientRect().left + 1;
  const past = shownRight > v.getBoundingClientRect().right + 1;
  return under || past ? [title.textContent] : []; })"""
# A row's first line taller than one line of text: something wrapped.
WRAPPED = """() => [...document.querySelectorAll('.ddp-run-view .ddp-progress')]
  .map(e => e.parentElement).filter(line => line.getBoundingClientRect().height > 40).length"""


def notebook(root):
    import nbformat

    cells = [SETUP, FIT, FAIL, LONG]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / NAME))


def saved_outputs(path, deadline):
    """The text/plain of each widget display in the saved notebook, once the save is on disk."""
    while True:
        try:
            nb = json.loads(path.read_text())
            return [["".join(o.get("data", {}).get("text/plain", "")) for o in c.get("outputs", [])
                     if "application/vnd.jupyter.widget-view+json" in o.get("data", {})] for c in nb["cells"]]
        except (OSError, ValueError):
            assert time.monotonic() < deadline, "the notebook was not saved"
            time.sleep(0.2)


def test_panel_fits_at_1400px_shows_epochs_retries_once_and_says_when_it_is_stale(lab, tmp_path):  # noqa: F811
    root = lab[2]
    notebook(root)
    with open_notebook(lab, tmp_path, NAME) as page:
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        # The fit: an epoch table of 6 epochs with valid loss and acc, and the per-epoch plot.
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        fit_panel, fail_panel, long_panel = (cells.nth(i).locator(".jp-OutputArea-output").first for i in (1, 2, 3))
        expect(fit_panel).to_contain_text("succeeded", timeout=180_000)
        table = fit_panel.locator(".ddp-epochs")
        expect(table).to_contain_text("valid loss")
        expect(table).to_contain_text("acc")
        expect(table.locator("tr")).to_have_count(7)  # the header and 6 epochs
        expect(table).to_contain_text("6/6")
        # The failing launch: its card, then a double click on Retry.
        card = page.locator(".ddp-failure").first
        expect(card).to_contain_text("ValueError: boom at step 5", timeout=120_000)
        page.wait_for_function(KERNEL_READY, timeout=120_000)  # clicks are handled once the cells ran
        expect(fail_panel.locator(".ddp-last").nth(0)).to_contain_text("step ")  # not the FutureWarning
        expect(fail_panel.locator(".ddp-detail").first).to_contain_text("1 warning")
        # Nothing cut or wrapped in the rows at 1400 px.
        assert page.evaluate(CUT) == []
        assert page.evaluate(WRAPPED) == 0
        assert page.evaluate(PAST_EDGE) == []  # a long metric name wraps onto a line of its own
        expect(fit_panel.locator(".ddp-detail").first).to_contain_text(
            "accuracy_of_the_held_out_validation_split_per_epoch")
        fit_panel.scroll_into_view_if_needed()
        shot(fit_panel, "panel-fit-1400.png")
        fail_panel.scroll_into_view_if_needed()
        shot(fail_panel, "panel-failed-1400.png")
        fail_panel.get_by_role("button", name="Retry on single device").dblclick()
        retried = fail_panel.get_by_text(re.compile(r"retry of \S+ on cpu:0"))
        expect(fail_panel.get_by_text(re.compile(r"retry of \S+ on cpu:0 succeeded"))).to_be_visible(
            timeout=120_000)
        page.wait_for_function(KERNEL_READY, timeout=60_000)  # both clicks handled by now
        expect(retried).to_have_count(1)  # one retry for a double click
        page.set_viewport_size({"width": 1400, "height": 2400})  # the whole panel in view: the README's picture
        fail_panel.scroll_into_view_if_needed()
        page.wait_for_timeout(1500)  # (for the picture only: the retry's final plot is drawn after its title)
        shot(fail_panel, "panel-retried-once.png")
        page.set_viewport_size({"width": 1400, "height": 1000})
        # The fallback of every display says the outcome once saved (not "starting").
        page.evaluate("() => { window.jupyterapp.commands.execute('docmanager:save'); }")
        deadline = time.monotonic() + 60
        while True:
            outputs = saved_outputs(root / NAME, deadline)
            if any("succeeded" in t for t in outputs[1]) and any("failed" in t for t in outputs[2]):
                break
            assert time.monotonic() < deadline, outputs
            time.sleep(0.2)
        assert outputs[2][0].count("Run ") == 2 and "starting" not in outputs[1][0]  # the run and its retry
        # Kernel restart while the long run goes on: its panel says it is no longer updated.
        expect(long_panel).to_contain_text("running", timeout=60_000)
        assert page.evaluate(TITLE_OVER) == []  # Stop shown beside a title that may be cut, never over it
        page.set_viewport_size({"width": 700, "height": 900})  # narrow: the titles are cut, inside their box
        assert page.evaluate(TITLE_OVER) == []
        page.set_viewport_size({"width": 1400, "height": 1000})
        note = long_panel.locator(".ddp-stale-note")
        # (The note is drawn anew every tick: one read between a removal and its replacement is '' .)
        shown = ""
        for _ in range(100):
            shown = note.evaluate("e => e.isConnected ? getComputedStyle(e).visibility : ''")
            if shown:
                break
            page.wait_for_timeout(50)
        assert shown == "hidden"
        # Kernel -> Restart, without its confirmation dialog.
        page.evaluate("() => { window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.restart(); }")
        expect(note).to_be_visible(timeout=60_000)
        stop = long_panel.get_by_role("button", name="Stop")
        assert float(stop.evaluate("e => getComputedStyle(e).opacity")) < 0.5
        long_panel.scroll_into_view_if_needed()
        shot(long_panel, "panel-after-restart.png")
        page.screenshot(path=os.path.join(ARTIFACTS, "jupyterlab-1400.png"), full_page=True)
