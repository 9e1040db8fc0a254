"""A comparison in real JupyterLab and headless Chromium: the curves with their legend and axes,
the table of what differs with the equal config folded, a run training redrawn in place, and its
end drawn when it ends. Screenshots go to $DDP_NOTEBOOK_ARTIFACTS (default artifacts/)."""
import pytest
from playwright.sync_api import expect
from test_browser import KERNEL_READY, lab, open_notebook, run_cell, shot  # noqa: F401 - lab is a fixture

pytestmark = pytest.mark.browser

NAME = "experiments.ipynb"
CELLS = [
    """%load_ext ddp_notebook
import os, time, ddp_notebook
def train(ctx, marker, lr, epochs=4):
    step = 0
    for epoch in ctx.epochs(epochs):
        for _ in range(50):
            step += 1
            ctx.log(step=step, loss=lr / step ** 0.5)
        ctx.log(valid_loss=lr / (epoch + 1))
    while not os.path.exists(marker):  # holds its end until the marker exists
        ctx.log(step=step, loss=lr / step ** 0.5)
        time.sleep(0.05)
    return step
done = [ddp_notebook.launch(train, devices="cpu*2", args=(".", lr), name=f"lr={lr}") for lr in (0.3, 0.1)]
for run in done:
    run.wait(120)""",
    """live = ddp_notebook.launch(train, devices="cpu*2", args=("go", 0.03), name="lr=0.03")
ddp_notebook.compare(*done, live)""",
    """open("go", "w").close()
live.wait(120)""",
]


def notebook(root):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / NAME))


def test_a_comparison_in_jupyterlab_curves_table_and_a_live_run(lab, tmp_path):  # noqa: F811
    notebook(lab[2])
    with open_notebook(lab, tmp_path, NAME) as page:
        cells = page.locator(".jp-Notebook .jp-CodeCell")
        run_cell(page, 0)
        page.wait_for_function(KERNEL_READY, timeout=120_000)
        run_cell(page, 1)
        comparison = cells.nth(1).locator(".ddp-comparison")
        expect(comparison).to_be_visible(timeout=60_000)
        table = comparison.locator("table.ddp-compare")
        expect(table.locator("tr")).to_have_count(4)  # a header and a row per run
        expect(table.locator("th")).to_contain_text(["run", "status", "duration", "devices", "lr"])
        expect(table.locator("tr").nth(3)).to_contain_text("running")
        expect(comparison.locator("details summary")).to_contain_text("The same in every run")
        # redrawn in place while it trains: the image changes (the kernel is idle, no cell runs)
        first = comparison.locator("img.ddp-compare-plot").get_attribute("src")
        page.wait_for_function("""(first) => { const img = document.querySelector('.ddp-comparison img');
            return img && img.getAttribute('src') !== first; }""", arg=first, timeout=30_000)
        shot(comparison, "comparison-live.png")
        run_cell(page, 2)
        expect(cells.nth(1).locator("table.ddp-compare tr").nth(3)).to_contain_text("succeeded", timeout=60_000)
        expect(cells.nth(1).locator(".ddp-comparison")).not_to_contain_text("live: updates")
        shot(cells.nth(1).locator(".ddp-comparison"), "comparison-final.png")
