"""Tutorial 2 in real JupyterLab and headless Chromium: the failure card, then one-click retry."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

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


@pytest.fixture
def lab(tmp_path):
    home = tmp_path / "home"
    root = tmp_path / "root"
    root.mkdir()
    shutil.copy(os.path.join(HERE, "..", "notebooks", NOTEBOOK), root / NOTEBOOK)
    settings = home / "settings"
    (settings / "@jupyterlab" / "apputils-extension").mkdir(parents=True)
    (settings / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false", "checkForUpdates": False}))
    env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
               JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"))
    port, token = _free_port(), os.urandom(12).hex()
    server = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
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
    yield base, token
    server.terminate()
    server.wait(timeout=30)


def test_failure_card_and_one_click_retry_in_jupyterlab(lab, tmp_path):
    base, token = lab
    os.makedirs(ARTIFACTS, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "profile"), executable_path=CHROMIUM, headless=True,
            args=["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"],
            viewport={"width": 1400, "height": 1000})
        try:
            page = browser.new_page()
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}")
            page.wait_for_function(KERNEL_READY, timeout=120_000)
            page.evaluate("window.jupyterapp.commands.execute('notebook:run-all-cells')")
            card = page.locator(".ddp-failure").first
            expect(card).to_contain_text(
                "Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom at step 5", timeout=120_000)
            expect(page.locator(".ddp-failed-row").first).to_be_visible()
            expect(card).to_contain_text('raise ValueError(f"boom at step {step}")')
            page.wait_for_function(KERNEL_READY, timeout=120_000)  # clicks are handled once the cells ran
            panel = page.locator(".jp-OutputArea-output", has=page.locator(".ddp-failure")).first
            panel.scroll_into_view_if_needed()
            panel.screenshot(path=os.path.join(ARTIFACTS, "panel-failure.png"))
            page.get_by_role("button", name="Retry on single device").first.click()
            retried = page.get_by_text(re.compile(r"retry of \S+ on cpu:0 succeeded"))
            expect(retried).to_be_visible(timeout=120_000)
            retried.scroll_into_view_if_needed()
            panel.screenshot(path=os.path.join(ARTIFACTS, "panel-retry.png"))
            page.screenshot(path=os.path.join(ARTIFACTS, "jupyterlab.png"))
        finally:
            browser.close()
