"""How a run shows in a notebook (``ui.display``): the form its views take (``ui=``, or
``$DDP_NOTEBOOK_UI``), checked before anything starts, and in a real kernel the HTML and text
forms kept current in place while a run trains, never as a widget."""
from __future__ import annotations

import time

import pytest

from ddp_notebook.errors import LaunchOptionError
from ddp_notebook.lifecycle.options import LaunchOptions, ui_form


@pytest.mark.unit
def test_the_form_is_the_option_else_the_environment_else_the_panel(monkeypatch):
    monkeypatch.delenv("DDP_NOTEBOOK_UI", raising=False)
    assert ui_form(None) == "auto" and ui_form("html") == "html"
    monkeypatch.setenv("DDP_NOTEBOOK_UI", "text")
    assert ui_form(None) == "text" and ui_form("widget") == "widget"
    assert ui_form("HTML") == "html" and ui_form(" Text ") == "text"  # any case, as device lists take
    with pytest.raises(LaunchOptionError, match=r"ui must be 'widget', 'html', 'text' or None .*not 'fancy'") as e:
        LaunchOptions(ui="fancy")
    # Told from the user's call, without the dataclass __init__ the package generated and called.
    from ddp_notebook.core.tracebacks import format_user_traceback
    assert "<string>" not in format_user_traceback(e.value), format_user_traceback(e.value)
    monkeypatch.setenv("DDP_NOTEBOOK_UI", "Fancy")
    with pytest.raises(LaunchOptionError, match=r"\$DDP_NOTEBOOK_UI is 'Fancy'"):  # as the user wrote it
        LaunchOptions()  # said before anything starts


@pytest.mark.unit
def test_in_colab_the_form_is_html_unless_chosen(monkeypatch):
    # Colab imports google.colab in its kernel; its widgets show nothing a thread changes.
    import sys
    import types

    monkeypatch.delenv("DDP_NOTEBOOK_UI", raising=False)
    monkeypatch.setitem(sys.modules, "google.colab", types.ModuleType("google.colab"))
    assert ui_form(None) == "html" and ui_form("widget") == "widget"
    monkeypatch.setenv("DDP_NOTEBOOK_UI", "widget")
    assert ui_form(None) == "widget"


@pytest.mark.kernel
@pytest.mark.processes
@pytest.mark.parametrize("form, mime", [("html", "text/html"), ("text", "text/plain")])
def test_a_run_shown_as_html_or_text_is_kept_current_in_place_never_as_a_widget(form, mime):
    import re

    from helpers import started_kernel

    km, kc = started_kernel()
    try:
        shown, widgets_made = [], []

        def hook(msg):
            if msg["msg_type"] in ("display_data", "update_display_data"):
                shown.append((msg["msg_type"], msg["content"]["data"]))
            elif msg["msg_type"] == "comm_open":
                widgets_made.append(msg["content"].get("target_name"))

        code = ("import time, ddp_notebook\n"
                "def train(ctx, steps=40):\n"
                "    for step in range(1, steps + 1):\n"
                "        ctx.log(step=step, total=steps, loss=1.0 / step)\n"
                "        time.sleep(0.1)\n"
                "    return steps\n"
                f"run = ddp_notebook.launch(train, devices='cpu*2', ui={form!r})\n"
                "run")
        reply = kc.execute_interactive(code, timeout=120, output_hook=hook)
        assert reply["content"]["status"] == "ok"
        deadline = time.monotonic() + 60
        while not any("succeeded" in data.get("text/plain", "") for _, data in shown) and time.monotonic() < deadline:
            try:
                msg = kc.get_iopub_msg(timeout=1)
            except Exception:  # noqa: BLE001 - queue.Empty: look again until the deadline
                continue
            hook(msg)
        assert shown and shown[0][0] == "display_data"
        assert all("application/vnd.jupyter.widget-view+json" not in data for _, data in shown)
        assert all(set(data) == ({"text/plain", "text/html"} if form == "html" else {"text/plain"}) for _, data in shown)
        steps = {int(m.group(1)) for _, data in shown for m in [re.search(r"step (\d+)/40", data[mime])] if m}
        assert len(steps) >= 3, steps  # kept current while it trained, not only at its status changes
        assert "succeeded" in shown[-1][1]["text/plain"] and "step 40/40" in shown[-1][1][mime]
        assert widgets_made == []  # no widget is made for a form that shows none
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.processes
def test_ddp_fit_takes_the_form_and_refuses_one_it_does_not_know(ipython_shell):
    from IPython.core.error import UsageError

    shell = ipython_shell
    shell.run_line_magic("load_ext", "ddp_notebook")
    shell.user_ns["quick"] = lambda ctx: ctx.rank
    with pytest.raises(UsageError, match=r"argument --ui: invalid choice: 'fancy'"):
        shell.run_line_magic("ddp_fit", "quick --ui fancy -d cpu*2")
    run = shell.run_line_magic("ddp_fit", "quick --ui text -d cpu*2 --wait")
    assert shell.user_ns["_ddp_run"].options.ui == "text" and run == 0


@pytest.mark.kernel
@pytest.mark.processes
def test_a_session_takes_the_form_too():
    from helpers import started_kernel

    km, kc = started_kernel()
    try:
        shown = []

        widgets_made = []

        def hook(msg):
            if msg["msg_type"] in ("display_data", "update_display_data"):
                shown.append(msg["content"]["data"])
            elif msg["msg_type"] == "comm_open":
                widgets_made.append(msg["content"].get("target_name"))

        reply = kc.execute_interactive("%load_ext ddp_notebook\n%ddp_session cpu*2 --ui html", timeout=120,
                                       output_hook=hook)
        assert reply["content"]["status"] == "ok" and widgets_made == [], widgets_made
        assert shown and set(shown[0]) == {"text/plain", "text/html"}, shown[0].keys()
        assert shown[0]["text/plain"].startswith("Session ") and 'class="ddp-fallback"' in shown[0]["text/html"]

        def updates(seconds: float, until: str = "") -> list[dict]:
            """The display's updates (whichever cell's) over ``seconds``, or until one says ``until``."""
            got: list[dict] = []
            end = time.monotonic() + seconds
            while time.monotonic() < end and not (until and any(until in d["text/plain"] for d in got)):
                try:
                    msg = kc.get_iopub_msg(timeout=0.2)
                except Exception:  # noqa: BLE001 - queue.Empty: look again until the end
                    continue
                if msg["msg_type"] == "update_display_data":
                    got.append(msg["content"]["data"])
            return got

        updates(2.0)  # (what the forming sent on its way)
        assert updates(3.0) == []  # idle: nothing changes, so its HTML form, paced, is not sent again
        kc.execute("%%ddp\nimport time; time.sleep(2.0); rank")
        seen = updates(60.0, until="in cell 1")
        assert any("in cell 1" in data["text/plain"] for data in seen), seen  # a cell runs: the display says so
        assert kc.get_shell_msg(timeout=60)["content"]["status"] == "ok"
        reply = kc.execute_interactive("%ddp_session --stop", timeout=120)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.kernel
@pytest.mark.processes
def test_a_notebook_run_without_a_front_end_keeps_each_runs_final_state(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    marker = str(tmp_path / "go")
    setup = ("import os, time, ddp_notebook\n"
             "def train(ctx, marker):\n"
             "    while not os.path.exists(marker):\n"
             "        ctx.log(loss=1.0)\n"
             "        time.sleep(0.05)\n"
             "    return 'done'")
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_code_cell(setup),
        nbformat.v4.new_code_cell(f"run = ddp_notebook.launch(train, devices='cpu*2', args=({marker!r},))\nrun"),
        nbformat.v4.new_code_cell(f"html = ddp_notebook.launch(train, devices='cpu*2', args=({marker!r},), "
                                  "ui='html')\nhtml"),
        nbformat.v4.new_code_cell(f"open({marker!r}, 'w').close()\nrun.wait(120), html.wait(120)"),
    ])
    NotebookClient(nb, timeout=180, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}).execute()
    for cell in nb.cells[1:3]:  # each launch's cell ends on its run's outcome, in text and HTML
        [shown] = [o for o in cell.outputs if o.get("output_type") in ("display_data", "execute_result")]
        assert "succeeded" in shown["data"]["text/plain"], shown["data"]["text/plain"]
        assert "succeeded" in shown["data"]["text/html"] and "starting" not in shown["data"]["text/plain"]
