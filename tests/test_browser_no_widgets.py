"""Where widgets do not render: JupyterLab in headless Chromium with ipywidgets' manager disabled
(what a front end without it shows). No view of the panel opens, so its display is sent again as
HTML at the panel's own pace: the steps and the clock move while the run trains, and the final
state stays. Screenshots go to $DDP_NOTEBOOK_ARTIFACTS (default artifacts/)."""
import re

import pytest
from playwright.sync_api import expect
from test_browser import ARTIFACTS, KERNEL_READY, lab, open_notebook, run_cell, serve_lab, shot  # noqa: F401 - lab is a fixture

pytestmark = pytest.mark.browser

NAME = "no-widgets.ipynb"
CELLS = [
    '''import time, ddp_notebook

def train(ctx, steps=120):
    for step in range(1, steps + 1):
        ctx.log(step=step, total=steps, loss=1.0 / step)
        time.sleep(0.1)
    return steps

run = ddp_notebook.launch(train, devices="cpu*2")
run''',
]


@pytest.fixture
def lab_without_widgets(tmp_path):
    with serve_lab(tmp_path, disabled=["@jupyter-widgets/jupyterlab-manager"]) as served:
        yield served


def test_a_panel_no_front_end_renders_shows_its_run_move_as_html_and_ends_on_its_outcome(lab_without_widgets,
                                                                                          tmp_path):
    import nbformat

    root = lab_without_widgets[2]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / NAME))
    with open_notebook(lab_without_widgets, tmp_path, NAME) as page:
        run_cell(page, 0, wait=False)
        out = page.locator(".jp-Notebook .jp-CodeCell").nth(0).locator(".jp-OutputArea")
        fallback = out.locator(".ddp-fallback")
        expect(fallback).to_contain_text(re.compile(r"step \d+/120"), timeout=60_000)
        steps = set()
        for _ in range(40):  # the steps move while it trains (several redraws, not one)
            found = re.search(r"rank 0 cpu:0 \(main\) +running +step (\d+)/120", fallback.inner_text())
            if found:
                steps.add(int(found.group(1)))
            if len(steps) >= 3:
                break
            page.wait_for_timeout(500)
        assert len(steps) >= 3, steps
        shot(out, "no-widgets-running.png")
        expect(fallback).to_contain_text("succeeded", timeout=120_000)
        expect(fallback).to_contain_text("step 120/120")
        expect(out.locator("img.ddp-fallback-plot")).to_be_visible()
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        shot(out, "no-widgets-final.png")


def test_where_widgets_render_the_panel_counts_its_view_so_its_html_form_is_never_sent(lab, tmp_path):  # noqa: F811
    import nbformat

    root = lab[2]
    cells = [CELLS[0].replace("run = ddp_notebook.launch(train, devices=\"cpu*2\")\nrun",
                              "from ddp_notebook.ui.display import show_run\n"
                              "panel = show_run(ddp_notebook.launch(train, devices=\"cpu*2\", kwargs={'steps': 30}))"),
             "import time\ndeadline = time.monotonic() + 60\n"
             "while not panel._view_count and time.monotonic() < deadline:\n    time.sleep(0.1)\n"
             "print('views', panel._view_count)"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / NAME))
    with open_notebook(lab, tmp_path, NAME) as page:
        run_cell(page, 0)
        run_cell(page, 1, wait=False)
        out = page.locator(".jp-Notebook .jp-CodeCell")
        expect(out.nth(1).locator(".jp-OutputArea")).to_contain_text(re.compile(r"views [1-9]"), timeout=60_000)
        expect(out.nth(0).locator(".ddp-run-view")).to_be_visible()
        expect(out.nth(0).locator(".ddp-fallback")).to_have_count(0)  # the widget, not its HTML form
