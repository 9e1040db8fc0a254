"""What shows where: the live panel in a notebook, text elsewhere.

``register(shell)`` makes the panel the display of every ``Run`` and of every ``Session`` (its
run's view) in an IPython shell (IPython's display formatter), so a run or a session that is the
value of a cell, or passed to ``display()``, shows live; the package does it on import inside
IPython, and the extension on load.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from html import escape
from typing import Any, Optional

from ..core.state import DataState
from ..core.validation import ValidationReport
from ..lifecycle.launch import show_while_waiting
from ..lifecycle.options import ui_form
from ..lifecycle.run import Run
from ..lifecycle.sending import show_while_sending
from ..lifecycle.session import Session
from .html import report_html
from .terminal import watch
from .text import format_data, format_run

__all__ = ["in_notebook", "show_run", "show_session", "show_report", "show_blocking_run", "show_sending", "register",
           "updater", "unregister"]


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def in_notebook() -> bool:
    """True inside a Jupyter kernel with ipywidgets available (False in terminal IPython, scripts)."""
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    shell = _shell()
    return shell is not None and getattr(shell, "kernel", None) is not None


def show_run(run: Run, launcher: Optional[Callable[[list[str]], Any]] = None,
             on_start: Optional[Callable[[Any], None]] = None, ui: Optional[str] = None) -> Any:
    """Display the live panel of ``run`` in a notebook (with ``launcher``: controls to relaunch
    it on other devices, offered and validated where it ran; ``on_start`` hears of every run the
    panel starts; ``ui``: the form it takes, default the run's ``ui`` option); print its state as
    text elsewhere."""
    ui = ui_form(ui if ui is not None else run.options.ui)
    if not in_notebook():
        print(format_run(run.state))
        return None
    controls = {} if launcher is None else {
        "launcher": launcher, "available": run._device_choices,  # found on a thread: torch's import
        "selected": [str(d) for d in run.devices], "validator": run._validate_devices}
    panel = view_of(run, ui, on_start=on_start, **controls)
    display_kept_current(panel, ui)
    return panel


#: The forms a run can take without a widget (``ui=``): its views are ``panel.StaticRuns``.
STATIC_FORMS = ("html", "text")


def view_of(run: Run, ui: str, **panel: Any) -> Any:
    """What shows ``run`` in the form ``ui``: its static forms, no widget made (``"html"``: HTML
    and text; ``"text"``), or the panel (``panel``: its arguments beside the run)."""
    from .panel import DDPPanel, StaticRuns  # ipywidgets: only in a notebook

    return StaticRuns(run, html=ui == "html") if ui in STATIC_FORMS else DDPPanel(run, **panel)


def display_kept_current(panel: Any, ui: str = "auto") -> None:
    """Display ``panel`` with a display id, and send its display again at each status change of
    its runs: what shows no widget (GitHub, nbviewer, nbconvert, a notebook reopened untrusted)
    shows the fallback of the last update, which ends on the outcome, not the "starting" of the
    first display. Where no front end opens a view of it within ``ui.panel.VIEW_WAIT`` (widgets that
    do not render: a front end without ipywidgets' manager, VS Code or Colab at times), its HTML
    form is sent again every ``ui.panel.HTML_PACE`` while its runs go on, when it changed: the steps,
    rates and clock move (an idle session's, which does not, is not sent again).
    ``ui`` (``lifecycle.options.ui_form``): ``"widget"``, the panel and never its HTML form kept
    current; ``"html"`` or ``"text"``, that form alone from the start, kept current so.

    The updates come from the display's own thread, the final one from the thread that saw the
    runs end (``ui.panel.KeptCurrent.keep_current``); they are sent in the context of
    the cell that displayed the panel (``contextvars``), whose output they update, whatever cell
    runs then; the final one also as the output of the cell running then (``run.wait()``'s, say),
    which is what a notebook executed without a front end (nbclient, papermill) takes and keeps.
    """
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.display import display

    from .panel import VIEW_WAIT

    static = ui in STATIC_FORMS
    if not static:
        panel._view_count = 0  # ipywidgets' view tracking: each front end view counts itself here
    handle = display(panel, display_id=True)
    if handle is None:  # no display id where nothing displays (a shell without a front end)
        return
    panel.display_handle = handle  # (what a notebook's build updates once more at its end)
    formatter = InteractiveShell.instance().display_formatter  # what display() sends of an object
    assert formatter is not None  # (display() gave a handle: a shell displays)
    update = updater(handle)

    def send(_panel: Any) -> None:
        data, metadata = formatter.format(_panel)
        update(data, metadata, not _panel.going_on())

    panel.keep_current(send, None if ui == "widget" else 0.0 if static else VIEW_WAIT)  # static: paced at once


def updater(handle: Any) -> Callable[[dict, dict, bool], None]:
    """How a display kept current in place (``handle``: its display id's) is updated, from any
    thread: ``update(data, metadata, final)`` sends the bundle in the context of the cell running
    now (the one that displayed it), unless it did not change since the last one sent (a paced
    send of an idle session's); a ``final`` one always, and again as the output of the cell
    running then, which is what a notebook executed without a front end (nbclient) keeps. The
    caller sends one at a time."""
    import contextvars

    cell = contextvars.copy_context()
    sent: list[Any] = []  # the last bundle sent

    def update(data: dict, metadata: dict, final: bool) -> None:
        if not final and sent == [data, metadata]:
            return
        sent[:] = [data, metadata]
        cell.copy().run(handle.update, data, metadata=metadata, raw=True)
        if final:
            handle.update(data, metadata=metadata, raw=True)

    return update


class _Report:
    def __init__(self, report: ValidationReport) -> None:
        self.report = report

    def _repr_html_(self) -> str:
        return report_html(self.report)

    def __repr__(self) -> str:
        return str(self.report)


def show_report(report: ValidationReport) -> None:
    """A validation report: a table with red errors in a notebook, text elsewhere."""
    if not in_notebook():
        print(report)
        return
    from IPython.display import display

    display(_Report(report))


def _display_run(run: Run) -> None:
    show_run(run)


def show_session(value: Session, ui: Optional[str] = None) -> None:
    """A session shows as its run's view (``show_run``; where it is formed again, its new run
    shows below, in the view shown last: ``restarts.followed``); its repr while no run holds its
    ranks. ``ui``: the form it takes (default its ``ui`` option, which its run has)."""
    run = value.current_run
    if run is None:
        print(repr(value))
        return
    panel = show_run(run, ui=ui)
    if panel is not None:  # the runs that follow show in this view, not in those shown before
        from .panel import follow_ons_only_in

        follow_ons_only_in(panel, run)


def show_blocking_run(run: Run) -> Optional[Callable[[], None]]:
    """How a run that the caller blocks on (``fit()``, ``spawn()``) shows: its live panel in a
    notebook; progress on stderr elsewhere, then its final table."""
    if in_notebook():

        ui = ui_form(run.options.ui)
        display_kept_current(view_of(run, ui), ui)
        return None
    return watch(run)


def show_sending(total: int) -> Callable[[int, int, Optional[float]], None]:
    """How a long copy of a call's data into shared memory shows while ``launch`` makes it: a line
    in the cell's output in a notebook (kept, with what it took), on stderr elsewhere."""
    if in_notebook():
        import ipywidgets as widgets
        from IPython.display import display

        line = widgets.HTML()
        display(line)

        def update(sent: int, total: int, seconds: Optional[float]) -> None:
            line.value = f"<code>{escape(format_data(DataState(total, sent, seconds=seconds)))}</code>"
    elif getattr(sys.stderr, "isatty", lambda: False)():
        def update(sent: int, total: int, seconds: Optional[float]) -> None:  # redrawn in place
            end = "\n" if seconds is not None else ""
            print(f"\r\x1b[2K{format_data(DataState(total, sent, seconds=seconds))}", end=end, file=sys.stderr,
                  flush=True)
    else:
        def update(sent: int, total: int, seconds: Optional[float]) -> None:  # a log: its first and last lines
            if sent == 0 or seconds is not None:
                print(format_data(DataState(total, sent, seconds=seconds)), file=sys.stderr, flush=True)
    update(0, total, None)
    return update


def register(shell: Any = None) -> None:
    """Show every ``Run`` through ``show_run`` and every ``Session`` through ``show_session`` in
    ``shell`` (default: the running IPython, if any), every run a caller blocks on
    (``show_blocking_run``) and every long copy of a call's data (``show_sending``)."""
    show_while_waiting(show_blocking_run)
    show_while_sending(show_sending)
    shell = shell if shell is not None else _shell()
    if shell is not None:
        shell.display_formatter.ipython_display_formatter.for_type(Run, _display_run)
        shell.display_formatter.ipython_display_formatter.for_type(Session, show_session)


def unregister(shell: Any) -> None:
    """Undo ``register``: a ``Run`` and a ``Session`` show as their repr again."""
    for shown in (Run, Session):
        shell.display_formatter.ipython_display_formatter.pop(shown, None)
