"""Tutorial 2 in real JupyterLab and headless Chromium: the failure card, then one-click retry."""
import contextlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import NamedTuple

import pytest

CHROMIUM = "/usr/bin/chromium"
NOTEBOOK = "02_when_a_worker_fails.ipynb"
HERE = os.path.dirname(os.path.abspath(__file__))
ARTIFACTS = os.environ.get("DDP_NOTEBOOK_ARTIFACTS", os.path.join(HERE, "..", "artifacts"))

if not os.path.exists(CHROMIUM):
    if os.environ.get("CI"):
        raise RuntimeError("CI must install chromium (apt-get install -y chromium) for the browser test")
    pytest.skip("no /usr/bin/chromium here (apt-get install -y chromium)", allow_module_level=True)

from playwright.sync_api import expect, sync_playwright  # noqa: E402

pytestmark = pytest.mark.browser

KERNEL_READY = """() => { const w = window.jupyterapp && window.jupyterapp.shell.currentWidget;
  const k = w && w.sessionContext && w.sessionContext.session && w.sessionContext.session.kernel;
  return !!k && k.connectionStatus === 'connected' && k.status === 'idle'; }"""


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab(NamedTuple):
    """A JupyterLab server as a test sees it: its URL and token, the test's folder (its notebooks go
    there, tutorial 2 is there), that folder's path from the server's root, and the server."""
    base: str
    token: str
    root: Path
    folder: str
    server: subprocess.Popen


@pytest.fixture
def lab(shared_lab, tmp_path):
    """The JupyterLab server of this test process's browser tests (``shared_lab``, conftest.py) with
    a folder of this test's, holding tutorial 2; the kernels started meanwhile are shut down as the
    test ends, as stopping the server would."""
    assert shared_lab.server.poll() is None, "the shared JupyterLab server has exited"
    folder = tmp_path.name
    (shared_lab.root / folder).mkdir()
    shutil.copy(os.path.join(HERE, "..", "notebooks", NOTEBOOK), shared_lab.root / folder / NOTEBOOK)
    try:
        yield shared_lab._replace(root=shared_lab.root / folder, folder=folder)
    finally:
        shut_down_kernels(shared_lab)


def shut_down_kernels(lab):
    """Every kernel of ``lab``'s server shut down through its API (as the server does as it stops),
    once its processes have ended."""
    import psutil

    def api(method, path):
        request = urllib.request.Request(f"{lab.base}{path}?token={lab.token}", method=method)
        with urllib.request.urlopen(request, timeout=120) as answer:
            return json.loads(answer.read() or b"null")

    running = psutil.Process(lab.server.pid).children()  # the kernels
    for session in api("GET", "/api/sessions"):
        api("DELETE", f"/api/sessions/{session['id']}")
    for kernel in api("GET", "/api/kernels"):  # (one without a session)
        api("DELETE", f"/api/kernels/{kernel['id']}")
    _, alive = psutil.wait_procs(running, timeout=60)
    assert not alive, f"kernels still running after their shutdown: {[p.pid for p in alive]}"


@contextlib.contextmanager
def serve_lab(tmp_path, disabled=()):
    """A JupyterLab server of its own (home, settings and root under ``tmp_path``), with the lab
    extensions ``disabled`` off (as ``jupyter labextension disable`` does): a ``Lab`` whose folder
    is the server's root."""
    home = tmp_path / "home"
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(os.path.join(HERE, "..", "notebooks", NOTEBOOK), root / NOTEBOOK)
    settings = home / "settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    if disabled:
        (home / "config" / "labconfig").mkdir(parents=True)
        (home / "config" / "labconfig" / "page_config.json").write_text(
            json.dumps({"disabledExtensions": {name: True for name in disabled}}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"))
    port, token = _free_port(), os.urandom(12).hex()
    # Its kernels are reached over Unix sockets, as helpers.started_kernel's are (why: there); a
    # short folder, as a socket's path is at most 107 bytes.
    sockets = tempfile.mkdtemp(prefix="ddp-notebook-lab-")
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
         "--KernelManager.transport=ipc", f"--KernelManager.ip={sockets}/k",
         f"--IdentityProvider.token={token}", "--allow-root", f"--ServerApp.root_dir={root}",
         "--LabApp.expose_app_in_browser=True", f"--LabApp.workspaces_dir={home / 'workspaces'}",
         f"--LabApp.user_settings_dir={settings}"],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "w"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:  # polling a server that says when it is up: there is nothing to wait on instead
        try:
            urllib.request.urlopen(f"{base}/api/status?token={token}", timeout=2)
            break
        except OSError:
            assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "lab.log").read_text()
            time.sleep(0.2)
    try:
        yield Lab(base, token, root, "", server)
    finally:
        server.terminate()
        server.wait(timeout=30)
        shutil.rmtree(sockets, ignore_errors=True)


def shot(locator, name, tries=5, scroll=None):
    """A screenshot of ``locator`` into ARTIFACTS, ``scroll`` (or it) scrolled into view first. A
    display kept current is drawn anew when its run or session changes status (its element
    replaced): the locators then find the new one."""
    from playwright.sync_api import Error

    for attempt in range(tries):
        try:
            (scroll or locator).scroll_into_view_if_needed()
            locator.screenshot(path=os.path.join(ARTIFACTS, name))
            return
        except Error as e:
            if "not attached to the DOM" not in str(e) or attempt == tries - 1:
                raise


@contextlib.contextmanager
def open_notebook(lab, tmp_path, name):
    """JupyterLab in headless Chromium with notebook ``name`` (in ``lab``'s folder) open and its
    kernel idle, in a workspace of its own (none of an earlier test's documents reopened): yields
    the page; Chromium is closed after."""
    base, token = lab.base, lab.token
    path = f"{lab.folder}/{name}" if lab.folder else name
    os.makedirs(ARTIFACTS, exist_ok=True)
    with sync_playwright() as p:
        browser = chromium(p, tmp_path)
        try:
            page = browser.new_page()
            page.goto(f"{base}/lab/workspaces/w{uuid.uuid4().hex[:12]}/tree/{path}?token={token}")
            page.wait_for_function(KERNEL_READY, timeout=120_000)
            yield page
        finally:
            browser.close()


def run_cell(page, index, wait=True):
    """Run cell ``index``; with ``wait``, until its execution is done (for a cell that does not block)."""
    page.evaluate("""async ([i, wait]) => { const nb = window.jupyterapp.shell.currentWidget.content;
        nb.activeCellIndex = i; const done = window.jupyterapp.commands.execute('notebook:run-cell');
        if (wait) { await done; } }""", [index, wait])


def chromium(p, tmp_path):
    return p.chromium.launch_persistent_context(
        str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
        args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync"],
        viewport={"width": 1400, "height": 1000})


def test_failure_card_and_one_click_retry_in_jupyterlab(lab, tmp_path):
    with open_notebook(lab, tmp_path, NOTEBOOK) as page:
        page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
        card = page.locator(".ddp-failure").first
        expect(card).to_contain_text(
            "Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom at step 5", timeout=120_000)
        expect(page.locator(".ddp-failed-row").first).to_be_visible()
        expect(card).to_contain_text('raise ValueError(f"boom at step {step}")')
        page.wait_for_function(KERNEL_READY, timeout=120_000)  # clicks are handled once the cells ran
        panel = page.locator(".jp-OutputArea-output", has=page.locator(".ddp-failure")).first
        shot(panel, "panel-failure.png")
        page.get_by_role("button", name="Retry on single device").first.click()
        retried = page.get_by_text(re.compile(r"retry of \S+ on cpu:0 succeeded"))
        expect(retried).to_be_visible(timeout=120_000)
        shot(panel, "panel-retry.png", scroll=retried)
        page.screenshot(path=os.path.join(ARTIFACTS, "jupyterlab.png"))


LONG = '''HOSTILE = '<img src=x onerror="window.__xss = 1">'   # what a run may send: shown as text, never run

def long_train(ctx):                         # a long run: until it is stopped
    step = 0
    print(HOSTILE, flush=True)
    while not ctx.should_stop:
        step += 1
        ctx.log(step=step, loss=1.0 / step, sample=HOSTILE)
        time.sleep(0.05)
    return step'''


def readme_notebook(root):
    """A notebook made of the README's python blocks, a cell each, in order (as a newcomer pastes
    them), then a long run shown in a panel and waited for."""
    import nbformat
    from test_readme import python_blocks

    cells = python_blocks() + ["import time\n" + LONG, "%ddp_fit long_train",
                               "print('Waiting for the run', flush=True)\n_ddp_run.wait()"]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(root / "readme.ipynb"))
    return "readme.ipynb"


def test_readme_blocks_then_a_long_run_interrupted_stopped_and_relaunched(lab, tmp_path):
    root = lab[2]
    name = readme_notebook(root)
    with open_notebook(lab, tmp_path, name) as page:
        # Not awaited: the last cell blocks until it is interrupted.
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        # The README's blocks ran: the fit block's value, its last validation loss, near 0 (it learned).
        expect(page.locator(".jp-OutputArea-output").get_by_text(re.compile(r"^\d\.\d+e-\d+$|^0\.0\d*$")).first
               ).to_be_visible(timeout=180_000)
        # The long run trains; the last cell waits for it: interrupt the kernel.
        long_panel = page.locator(".jp-OutputArea-output", has=page.get_by_role("button", name="Launch")).last
        expect(long_panel).to_contain_text("running", timeout=120_000)
        # A metric and a printed line hold markup: it shows as text and no script ran.
        expect(long_panel).to_contain_text('sample <img src=x onerror="window.__xss = 1">', timeout=60_000)
        assert page.evaluate("() => window.__xss") is None
        assert long_panel.locator("img[src=x]").count() == 0
        launch = long_panel.get_by_role("button", name="Launch")
        expect(launch).to_be_disabled()  # one run at a time in a panel
        # Interrupted once the kernel is in the last cell: an interrupt while it is between two
        # cells is lost (ipykernel interrupts a cell), and the run would go on (CI saw it once).
        expect(page.locator(".jp-OutputArea-output").get_by_text("Waiting for the run")).to_be_visible(timeout=60_000)
        page.evaluate("() => { window.jupyterapp.commands.execute('kernelmenu:interrupt'); }")
        # One line, once the run has stopped: no KeyboardInterrupt traceback.
        expect(page.get_by_text(re.compile(r"Run \S+ stopped: interrupted in the notebook"))).to_be_visible(
            timeout=60_000)
        expect(page.get_by_text("KeyboardInterrupt")).to_have_count(0)
        expect(long_panel).to_contain_text("stopped", timeout=60_000)
        expect(long_panel).to_contain_text("interrupted in the notebook")
        page.wait_for_function(KERNEL_READY, timeout=60_000)
        shot(long_panel, "interrupted.png")
        # Relaunch from the panel (a double click starts one run), then stop it with its button.
        expect(launch).to_be_enabled(timeout=60_000)
        launch.dblclick()
        stop = long_panel.get_by_role("button", name="Stop")  # the new run's: a stopped run's is hidden
        expect(stop).to_have_count(1, timeout=60_000)
        # The double click's second click is the same click sequence: ignored, not refused aloud.
        expect(long_panel.get_by_text(re.compile(r"stop it before launching"))).to_have_count(0)
        stop.click()
        # Forked ranks see the stop at once: "Stopping (stopped by the user)" may be gone before a
        # look; the outcome must say who stopped it, and nothing may still say "Stopping".
        expect(long_panel.get_by_text(re.compile(r"Stopped: stopped by the user"))).to_be_visible(timeout=60_000)
        expect(long_panel.get_by_text("Stopping")).to_have_count(0, timeout=60_000)
        expect(launch).to_be_enabled(timeout=60_000)
        expect(long_panel.get_by_text("stop it before launching")).to_have_count(0)  # no longer true
        shot(long_panel, "relaunched-and-stopped.png")
        long_panel.get_by_text("Output per device").first.click()  # the printed markup, as text
        expect(long_panel).to_contain_text('<img src=x onerror="window.__xss = 1">')
        assert page.evaluate("() => window.__xss") is None and long_panel.locator("img[src=x]").count() == 0
