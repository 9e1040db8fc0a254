"""The live view of one run (ipywidgets 8): it renders the run's state and nothing else.

``RunView`` shows a header with Stop, one row per rank (status badge, progress bar,
step/epoch/loss/rate/elapsed, last output line), a loss plot, the failure card with its retry
buttons, and each rank's output. It needs only ``state`` and ``subscribe`` of what it shows: a
``Run``, or a ``core.stream.EventStream`` fed by hand (a log read from disk, a test).

A session's run is shown as a session: each rank's row says what it does in the session (idle,
in cell 3 on a ticking clock, failed in cell 3), a line says the request in flight or how the
last one ended, a failed cell's card holds the failed rank's locals, Stop interrupts a cell run
without blocking (a blocking cell holds the kernel, where a click would wait for its end: the
line says Kernel → Interrupt stops it), and once the session has ended its card re-forms it
(``Run.retry`` of a session's run forms its session again).

Widget attributes are set from the refresher thread: ipywidgets sends those updates while a
cell runs, whereas button clicks wait until the kernel is idle, which is why launches return
at once.
"""
from __future__ import annotations

import base64
import contextlib
import io
import re
import threading
import time
import uuid
from collections.abc import Callable
from html import escape
from typing import Any, Optional

import ipywidgets as widgets

from ..core.console import one_line as plain
from ..core.errors import DDPNotebookError
from ..core.events import EventKind
from ..core.state import RunState, RunStatus, WorkerStatus, train_loss_of, valid_loss_of
from ..lifecycle.session_state import formed_after, session_of
from .html import (
    ORANGE,
    RED,
    badge,
    cell_card_html,
    epoch_table_html,
    failure_card_html,
    liveness_html,
)
from .loss_plot import LossPlot, epoch_plot_png, plot_png
from .text import (
    format_data,
    format_duration,
    format_memory,
    format_metric,
    format_rate,
    format_run,
    request_text,
    session_lines,
    session_rank_text,
)

__all__ = ["RunView", "RunForms", "FullText", "StartGuard", "last_output"]

REFRESH_S = 0.25  # widget updates at most this often
TICK_S = 1.0  # and at least this often while the run goes on: the clock and silences move without events
PLOT_S = 1.0  # the loss plot is redrawn at most this often
OUTPUT_SHOWN = 200  # lines of each rank's output its tab shows (the run's log has them all)
CLICK_SEQUENCE_S = 1.0  # a second click this soon after a start is the same click sequence (a double click)


class FullText:
    """The fallback of a widget's display, for what shows no widgets (GitHub, nbviewer, nbconvert,
    an untrusted notebook): ``text/plain``, the run's text view whole (ipywidgets cuts it to 110
    characters; nbval reads it), and ``text/html``, the same with the epoch table and the failure
    card. A display kept current (``ui.display``) sends them again at each status change."""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        data = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data["text/plain"] = repr(self)
        data["text/html"] = self.fallback_html()
        return data

    def fallback_html(self) -> str:
        raise NotImplementedError


# A row is two lines that never wrap: fixed columns (rank, status, bar, progress, the last line
# printed) above the rank's metrics. Text past a column's width ends in an ellipsis, with the
# whole text on hover.
NOWRAP = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis"
METRIC = ("display:inline-block;max-width:100%;white-space:nowrap;overflow:hidden;text-overflow:ellipsis;"
          "vertical-align:bottom")
WRAP = "white-space:normal;overflow-wrap:anywhere;line-height:1.4;height:auto"
NAME_WIDTH, BADGE_WIDTH, BAR_WIDTH, TEXT_WIDTH = 150, 80, 140, 380  # px
# The warnings module's line ("file.py:12: DeprecationWarning: ...") and the source line under it.
WARNING_LINE = re.compile(r"^\S.*:\d+: ([A-Za-z_][\w.]*)?Warning: ")
# Metrics in this order first; the rest as logged, samples/s last.
METRICS_FIRST = ("loss", "train_loss", "valid_loss", "val_loss")


def one_line(html: str, title: str = "") -> str:
    """``html`` on one line, cut with an ellipsis at its column's width (``title`` on hover)."""
    hover = f' title="{escape(title)}"' if title else ""
    return f'<div style="{NOWRAP}"{hover}>{html}</div>'


def last_output(output: Any) -> tuple[str, str, int]:
    """The line a row shows of a rank's output: the last one that is not a warning (a library's
    deprecation warning says nothing of the run), its stream, and how many warnings came after
    it or before.

    >>> last_output([("stdout", "epoch 1 done"),
    ...              ("stderr", "/x/lib.py:3: DeprecationWarning: old"), ("stderr", "  old()")])
    ('stdout', 'epoch 1 done', 1)
    """
    lines = list(output)
    warnings = sum(1 for _stream, text in lines if WARNING_LINE.match(text))
    i = len(lines) - 1
    while i >= 0:
        stream, text = lines[i]
        if WARNING_LINE.match(text):
            i -= 1
        elif text[:1].isspace() and i > 0 and WARNING_LINE.match(lines[i - 1][1]):
            i -= 2  # a warning's source line, and the warning
        elif not text.strip():
            i -= 1
        else:
            return stream, text, warnings
    return "", "", warnings


def ordered_metrics(metrics: dict[str, Any]) -> list[tuple[str, Any]]:
    first = [(k, metrics[k]) for k in METRICS_FIRST if k in metrics]
    rest = [(k, v) for k, v in metrics.items() if k not in METRICS_FIRST and k != "samples_per_s"]
    rate = [("samples/s", metrics["samples_per_s"])] if "samples_per_s" in metrics else []
    return first + rest + rate


class _Row:
    """The widgets of one rank: a line of fixed columns, and its metrics on the line below."""

    def __init__(self, rank: int, device: str, place: Optional[str] = None) -> None:
        main = " <i>main</i>" if rank == 0 else ""
        self.place = place
        self.name = widgets.HTML(one_line(f"<b>rank {rank}</b> <code>{escape(device)}</code>{main}",
                                          f"rank {rank} {device}" + (f" on {place}" if place else "")),
                                 layout=widgets.Layout(width=f"{NAME_WIDTH}px", flex="0 0 auto"))
        self.badge = widgets.HTML(layout=widgets.Layout(width=f"{BADGE_WIDTH}px", flex="0 0 auto"))
        self.bar = widgets.FloatProgress(value=0.0, min=0.0, max=1.0,
                                         layout=widgets.Layout(width=f"{BAR_WIDTH}px", flex="0 0 auto"))
        self.text = widgets.HTML(layout=widgets.Layout(width=f"{TEXT_WIDTH}px", flex="0 0 auto"))
        self.last = widgets.HTML(layout=widgets.Layout(flex="1 1 0", min_width="0"))
        self.detail = widgets.HTML(layout=widgets.Layout(margin=f"-4px 0 0 {NAME_WIDTH + 4}px", min_width="0",
                                                        height="auto"))
        for widget, name in ((self.text, "ddp-progress"), (self.detail, "ddp-detail"), (self.last, "ddp-last"),
                             (self.badge, "ddp-rank-status")):
            widget.add_class(name)  # stable hooks for browser tests
        line = widgets.HBox([self.name, self.badge, self.bar, self.text, self.last],
                            layout=widgets.Layout(flex_flow="row nowrap", align_items="center"))
        self.box = widgets.VBox([line, self.detail], layout=widgets.Layout(padding="1px 2px",
                                                                          border="1px solid transparent"))
        self.box.add_class("ddp-rank")


class StartGuard:
    """One run per click sequence for a button that starts a run: a start is refused while the
    run it started last goes on, and a second click of the same sequence (a double click, whose
    second click reaches the kernel before the button shows as disabled) is ignored; from any
    number of threads at once.
    """

    def __init__(self, before: str = "starting another", sequence_s: float = CLICK_SEQUENCE_S) -> None:
        self.before = before  # what the refusal says to stop the run before
        self.sequence_s = sequence_s
        self.run: Any = None  # the run started last
        self._started_at = -float("inf")
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """Whether the run started last goes on."""
        return self.run is not None and not self.run.state.finished

    def start(self, begin: Callable[[], Any]) -> tuple[Any, str]:
        """Call ``begin() -> run`` unless a start is refused now: ``(run, "")``, or ``(None, why)``
        (``why`` is empty for the ignored second click of a double click)."""
        with self._lock:  # held while begin() runs: a click meanwhile waits, then sees its run
            if time.monotonic() - self._started_at < self.sequence_s:
                return None, ""
            if self.busy:
                state = self.run.state
                return None, f"Run {state.run_id} is still {state.status}: stop it before {self.before}."
            run = begin()
            if run is not None:
                self.run, self._started_at = run, time.monotonic()
            return run, ""


class RunView(FullText, widgets.VBox):
    """Live view of one run (a ``Run``, or anything with ``state`` and ``subscribe``).

    ``on_retry(devices) -> run`` is called by the card's retry buttons; the panel that owns the
    view shows the new run below it. The retry buttons start one run per click sequence and are
    disabled while it goes on.
    """

    def __init__(self, run: Any, title: Optional[str] = None,
                 on_retry: Optional[Callable[[list[str]], Any]] = None, live: Optional[bool] = None) -> None:
        super().__init__()
        self.run = run
        self.on_retry = on_retry
        self.retries = StartGuard("retrying again")
        # A class of this view's own (random: a panel left from before a kernel restart keeps its
        # DOM, and a new kernel's view must not keep the old one looking alive).
        self.token = uuid.uuid4().hex[:12]
        self.add_class("ddp-run-view")
        self.add_class(f"ddp-view-{self.token}")
        # Shrinks before Stop does, its text cut with an ellipsis inside its own box (never under Stop,
        # never past the view's edge).
        self.title = widgets.HTML(layout=widgets.Layout(min_width="0", flex="0 1 auto", overflow="hidden"))
        self.title.add_class("ddp-title")
        self.subtitle = title
        self.live = widgets.HTML(layout=widgets.Layout(flex="0 0 auto"))  # re-rendered every tick while the run lives
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="warning",
                                          layout=widgets.Layout(width="90px", flex="0 0 auto"))
        self.stop_button.on_click(lambda _: self._stop())
        self.stop_button.add_class("ddp-stop")
        self.rows: dict[int, _Row] = {}
        self.rows_box = widgets.VBox()
        self.plot = LossPlot()
        self.epoch_plot = widgets.Image(format="png", layout=widgets.Layout(width="420px", display="none"))
        self.epoch_table = widgets.HTML()
        self.card = widgets.HTML()
        self.retry_device = widgets.Dropdown(description="device", layout=widgets.Layout(width="200px"))
        self.retry_single = widgets.Button(description="Retry on single device", button_style="primary",
                                           icon="redo", layout=widgets.Layout(width="210px"))
        self.retry_without = widgets.Button(description="Retry without the failed device", icon="redo",
                                            layout=widgets.Layout(width="270px"))
        # A session's: formed again on its devices (its ranks' namespaces are lost, which the note says).
        self.reform = widgets.Button(description="Re-form", icon="redo", button_style="primary",
                                     layout=widgets.Layout(width="110px", display="none"))
        self.reform.add_class("ddp-reform")
        self.retry_single.on_click(lambda _: self._retry(lambda: [self.retry_device.value]))
        self.retry_without.on_click(lambda _: self._retry(self._healthy_devices))
        self.reform.on_click(lambda _: self._retry(lambda: list(self.run.state.devices)))
        self.retry_note = widgets.HTML()
        self.retry_box = widgets.VBox([widgets.HBox([self.reform, self.retry_device, self.retry_single,
                                                     self.retry_without]), self.retry_note])
        self.card_box = widgets.VBox([self.card, self.retry_box], layout=widgets.Layout(display="none"))
        self.outputs = widgets.Tab()
        self.output_box = widgets.Accordion(children=[self.outputs], titles=("Output per device",),
                                            selected_index=None)
        self.note = widgets.HTML()  # what the run is doing that the rows do not say (stopping, ...)
        self.message = widgets.HTML()  # the outcome of the user's last action here (a retry refused)
        header = widgets.HBox([self.title, self.stop_button, self.live],
                              layout=widgets.Layout(align_items="center", flex_flow="row nowrap"))
        for dimmed in (self.title, self.stop_button, self.rows_box, self.retry_single, self.retry_without):
            dimmed.add_class("ddp-dims")  # what a view no longer updated dims (liveness_html)
        self.children = [header, self.note, self.rows_box,
                         widgets.HBox([self.plot, self.epoch_plot], layout=widgets.Layout(flex_flow="row wrap")),
                         self.epoch_table, self.card_box, self.message, self.output_box]
        self._dirty = threading.Event()
        self._plotted_at = 0.0
        self._plotted_points: Any = None
        self.forms = RunForms(run)  # its text and HTML, for what shows no widgets
        self._epochs_drawn: Any = None
        self._epochs_plotted_at = 0.0
        self._tick = 0
        self._closed = False
        self._lock = threading.Lock()
        run.subscribe(lambda _event: self._dirty.set())
        # Followed unless what was drawn is final: a run may end between the drawing and this
        # check (a forked run takes a tenth of a second), and its end would never be drawn.
        drawn_final = self.refresh()
        if live if live is not None else not drawn_final:
            threading.Thread(target=self._follow, name="ddp-panel", daemon=True).start()

    # ---- rendering -------------------------------------------------------------------------
    def _follow(self) -> None:
        while not self._closed:
            self._dirty.wait(TICK_S)
            self._dirty.clear()
            self.refresh()
            if getattr(self.run, "done", False) and self.run.state.finished:
                self.refresh(force_plot=True)
                return
            time.sleep(REFRESH_S)  # throttle: one redraw per period, however many events came

    def close(self) -> None:
        """Close the view (its widgets leave the notebook) and stop following its run."""
        self._closed = True
        self._dirty.set()
        super().close()

    def refresh(self, force_plot: bool = False, now: Optional[float] = None) -> bool:
        """Bring every widget in line with the run state (thread-safe); whether the state drawn
        was the run's final one. ``now``: the clock's time (default: the time now)."""
        with self._lock:
            state: RunState = self.run.state
            final = state.finished  # before drawing: nothing changes once the run has finished
            now = time.time() if now is None else now
            end = state.ended_at or now
            elapsed = f"{end - state.started_at:.1f} s" if state.started_at else ""
            etas = [e for e in (w.eta() for w in state.workers.values()) if e is not None]
            if etas and not state.finished:
                elapsed += f" · ETA {format_duration(max(etas))}"
            # A retry says so, wherever it was started (the card, %ddp_retry, run.retry()).
            session = state.origin == "session"
            again = "formed again after" if session else "retry of"
            retry = f"{again} {state.parent} on {','.join(state.devices)}" if state.parent else ""
            subtitle = self.subtitle or retry
            sub = f" — {escape(subtitle)}" if subtitle else ""
            if state.data is not None and (not state.data.sending or not state.finished):
                elapsed += f" · {escape(format_data(state.data))}"
            if state.waiting_for is not None:
                elapsed += f" · starting workers ({escape(state.waiting_for)})"
            if state.report_to:
                elapsed += f" · reports to {escape(', '.join(state.report_to))}"
            named = f" <b>{escape(state.name)}</b>" if state.name else ""
            if session:  # said by what it does, not by how long its run has lasted
                elapsed = f"{state.cells} cell{'s' if state.cells != 1 else ''} run" if state.cells else ""
            self.title.value = one_line(f"<b>{'Session' if session else 'Run'}</b>{named} "
                                        f"<code>{escape(state.run_id)}</code>{sub} "
                                        f"{badge(state.session_status if session else state.status)} on "
                                        f"<code>{escape(','.join(state.devices))}</code>" + (f" · {elapsed}" if elapsed
                                                                                          else ""))
            request = state.request
            # A session's Stop interrupts a cell run without blocking (a blocking one holds the kernel).
            stoppable = not session or (request is not None and request.cell is not None and request.background)
            self.stop_button.layout.display = "none" if state.finished or not stoppable else ""
            self.stop_button.disabled = session and request is not None and request.interrupting
            if state.finished:
                self.live.value = ""
            else:  # a new value every tick: what shows it knows the kernel still speaks (liveness_html)
                self._tick += 1
                self.live.value = liveness_html(self.token, self._tick)
            if set(self.rows) != set(state.workers):
                self.rows = {r: _Row(r, w.device, w.place) for r, w in sorted(state.workers.items())}
                self.rows_box.children = self._grouped(state)
                self.outputs.children = [widgets.HTML() for _ in self.rows]
                for i, r in enumerate(self.rows):
                    self.outputs.set_title(i, f"rank {r} {state.workers[r].label}")
            failed_ranks = state.causing_ranks
            last = state.last_request if state.request is None else None
            for r, row in self.rows.items():
                activity = session_rank_text(state, r, now)
                failed = next((f for f in last.failures if f.rank == r), None) if last and activity else None
                self._render_row(row, state.workers[r], r in failed_ranks or failed is not None, now, activity,
                                 plain(failed.summary()) if failed is not None else "")
            for i, r in enumerate(self.rows):
                self.outputs.children[i].value = output_html(state.workers[r])
            self._render_card(state)
            self.note.value = self._note(state, now)
            self._render_plot(state, now, force_plot)
            self._render_epochs(state, now, force_plot)
            return final

    def _grouped(self, state: RunState) -> list[widgets.Widget]:
        """The rows, under a heading per host when the ranks are on several (in rank order within)."""
        hosts = {r: w.host for r, w in state.workers.items()}
        if len(set(hosts.values())) <= 1:
            return [row.box for row in self.rows.values()]
        out: list[widgets.Widget] = []
        for host in dict.fromkeys(hosts.values()):  # in the order of their first rank
            ranks = [r for r in self.rows if hosts[r] == host]
            count = f"{len(ranks)} worker{'s' if len(ranks) != 1 else ''}"
            out.append(widgets.HTML(f'<div class="ddp-host" style="margin-top:4px;border-bottom:1px solid #ddd">'
                                    f"<b>host {escape(str(host))}</b> · {count}</div>"))
            out += [self.rows[r].box for r in ranks]
        return out

    def _note(self, state: RunState, now: float) -> str:
        trackers = "".join(f'<div class="ddp-tracker-note" style="color:{ORANGE}">{escape(note)}</div>'
                           for note in state.tracker_notes)  # a tracker missing, failing or behind: one line each
        return trackers + self._run_note(state, now)

    def _run_note(self, state: RunState, now: float) -> str:
        if state.supervisor_error is not None:
            return (f'<span style="color:{RED}">ddp_notebook\'s supervision of this run failed: '
                    f"{escape(state.supervisor_error)}</span>")
        if state.origin == "session":
            return self._session_note(state, now)
        stopping = state.stop_reason is not None or getattr(self.run, "stop_requested", False)
        if stopping and not state.finished:
            reason = f" ({escape(state.stop_reason)})" if state.stop_reason else ""
            return (f"<i>Stopping{reason}: each worker sees <code>ctx.should_stop</code> and may finish its step; "
                    "those still running after the grace period are ended.</i>")
        if state.status == RunStatus.STOPPED and state.stop_reason:
            return f"<i>Stopped: {escape(state.stop_reason)}.</i>"
        quiet = state.quiet_note
        if quiet is not None and not state.finished:  # who holds the others up, before any watchdog decides
            return f'<span class="ddp-quiet-run" style="color:{ORANGE}"><b>No progress:</b> {escape(quiet)}</span>'
        return ""

    def _session_note(self, state: RunState, now: float) -> str:
        """What a session's run does now, or how its last request ended, and how it ended."""
        colors = {"Last: ": {"ok": "#198754", "failed": RED, "interrupted": ORANGE}.get(
            state.last_request.status if state.last_request else "", "#6c757d"), "Last failure: ": RED}
        lines = []
        for line in session_lines(state, now):
            color = next((c for start, c in colors.items() if line.startswith(start)), "")
            lines.append(f'<div style="{WRAP};color:{color or "inherit"}">{escape(line)}</div>')
        quiet = state.quiet_note
        if quiet is not None and not state.finished:  # who holds the others up in the cell
            lines.append(f'<div class="ddp-quiet-run" style="{WRAP};color:{ORANGE}"><b>No progress:</b> '
                         f"{escape(quiet)}</div>")
        later = formed_after(self.run) if state.finished else None
        why = f" ({escape(state.stop_reason)})" if state.stop_reason else ""
        if later is not None:  # restart(), Re-form, a request cut: the session lives on in another run
            lines.append(f'<div style="{WRAP}"><b>Formed again</b> as run <code>{escape(later.id)}</code>, which holds '
                         f"the session's ranks now (the ranks of this run are gone){why}.</div>")
        elif state.session_status == "ended":
            lines.append(f'<div style="{WRAP};color:{RED}"><b>Ended</b>{why}: its ranks are gone; Re-form below forms '
                         "the session again (its namespaces are lost).</div>")
        elif not state.finished and state.stop_reason:
            lines.append(f'<div style="{WRAP}"><i>Stopping{why}: its ranks are being ended.</i></div>')
        elif state.session_status == "closed":
            lines.append(f'<div style="{WRAP}"><i>Closed: its ranks have left; ddp_notebook.session(...) or '
                         "%ddp_session forms a new one.</i></div>")
        return f'<div class="ddp-activity">{"".join(lines)}</div>'

    def _render_row(self, row: _Row, w: Any, caused_failure: bool, now: float, activity: Optional[str] = None,
                    failure: str = "") -> None:
        # A session's rank says what it does in the session (idle between cells is no stall): a
        # word in the badge, the request on the line, its clock the request's.
        shown = {"in": "running"}.get(activity.split()[0], activity.split()[0]) if activity else w.shown_status
        row.badge.value = badge(shown, ORANGE if w.shown_status == "knock-on" else None)
        # A session's rank has no steps unless a cell logs them: no bar until then (its column stays).
        row.bar.layout.visibility = "hidden" if activity is not None and not w.total else "visible"
        if w.total:
            row.bar.value = min(1.0, (w.step or 0) / w.total)
        elif w.status == "succeeded":
            row.bar.value = 1.0
        row.bar.bar_style = {"failed": "danger", "succeeded": "success", "stopped": "warning",
                             "knock-on": "warning"}.get(w.shown_status, "info")
        # The first line: where the rank is and for how long (what every row has, in its column).
        bits: list[str] = [activity] if activity and activity not in ("idle", "closed") else []
        if w.step is not None:
            bits.append(f"step {w.step}/{w.total}" if w.total else f"step {w.step}")
        if w.epoch is not None:
            bits.append(w.epoch_text)
        if w.status == "running" and format_rate(w):
            bits.append(format_rate(w))
        if activity is not None and w.pid:
            bits.append(f"pid {w.pid}")
        elif w.started_at and activity is None:
            bits.append(format_duration((w.ended_at or now) - w.started_at))
        text = " · ".join(bits)
        row.text.value = one_line(escape(text), text)
        # The second line: what the rank says of its training, all of it (names and values come from the run).
        detail: list[str] = [f'<span class="ddp-cell-error" style="color:{RED}">{escape(failure)}</span>'] \
            if failure else []
        silent = w.silent_for(now) if activity is None else None
        if silent is not None:
            detail.append(f'<b style="color:{ORANGE}">no progress for {format_duration(silent)}</b>')
        if w.note and w.status == "running":  # the run is quiet: where this rank waits or runs (its stack)
            detail.append(f'<span class="ddp-quiet" style="color:{ORANGE}">{escape(w.note)}</span>')
        if row.place:
            detail.append(f"<small>{escape(row.place)}</small>")
        memory = format_memory(w)
        if memory:  # which rank is about to run out
            detail.append(f'<span class="ddp-memory" style="color:#6c757d">{escape(memory)}</span>')
        # Each name with its value on one line (the line wraps between metrics, not inside one; a
        # name wider than the panel ends in an ellipsis, whole on hover).
        metrics = " · ".join(f'<span style="{METRIC}" title="{escape(text)}">{escape(text)}</span>'
                             for text in (f"{k} {format_metric(v)}" for k, v in ordered_metrics(w.metrics)))
        if metrics:
            detail.append(metrics)
        stream, line, warnings = last_output(w.output)
        if warnings:
            detail.append(f'<span style="color:#b8860b">⚠ {warnings} warning{"s" if warnings != 1 else ""} '
                          "(Output per device)</span>")
        # Wrapped, never cut: every metric shows, however long its name, whatever the panel's width.
        row.detail.value = f'<div style="{WRAP}">{" · ".join(detail)}</div>' if detail else ""
        color = RED if stream == "stderr" else "#6c757d"
        row.last.value = one_line(f'<code style="color:{color}">{escape(tail_of(line, 160))}</code>', line[-500:])
        row.box.layout.border = f"2px solid {RED}" if caused_failure else "1px solid transparent"
        if caused_failure:
            row.box.add_class("ddp-failed-row")  # a stable hook for styling and browser tests (added once)

    def _render_epochs(self, state: RunState, now: float, force: bool) -> None:
        main, last = _main_epochs(state)
        if main is None or not main.epoch_history:
            return
        records = main.epoch_history
        self.epoch_table.value = epoch_table_html(records, main.epochs, last)
        drawn = (len(records), records[-1].get("seconds"), last)
        if drawn == self._epochs_drawn or (not force and now - self._epochs_plotted_at < PLOT_S and last == "running"):
            return
        self._epochs_drawn, self._epochs_plotted_at = drawn, now
        shift = 1 if main.epochs else 0  # counted as the table counts them
        numbered = [r for r in records if isinstance(r.get("epoch"), int)]
        train = [(r["epoch"] + shift, v) for r in numbered if isinstance(v := train_loss_of(r), (int, float))]
        valid = [(r["epoch"] + shift, v) for r in numbered if isinstance(v := valid_loss_of(r), (int, float))]
        if train or valid:
            self.epoch_plot.value = epoch_plot_png(train, valid)
            self.epoch_plot.layout.display = ""

    def _render_card(self, state: RunState) -> None:
        root = state.root_failure
        session = state.origin == "session"
        # Re-formed from its card, whatever ended it, unless the session was formed again since.
        reform = session and state.session_status == "ended" and formed_after(self.run) is None
        if root is not None:
            self.card.value = failure_card_html(root, state.failures, state.healthy_devices)
        elif session and state.failed_cell is not None:  # the session goes on: fix the cell, run it again
            self.card.value = self._cell_card(state)
        elif reform:
            self.card.value = ""
        else:
            self.card_box.layout.display = "none"
            return
        options = list(state.devices)
        self.retry_device.options = options
        default = self._default_retry_device()
        if default in options and self.retry_device.value not in options:
            self.retry_device.value = default
        # Off while a retry started here goes on: one run per click sequence.
        has_retry = self.on_retry is not None and state.finished and not self.retries.busy
        self.reform.disabled = self.retry_single.disabled = not has_retry
        self.retry_without.disabled = not has_retry or not self._healthy_devices()
        self.retry_single.description = "Re-form on one device" if session else "Retry on single device"
        self.retry_without.description = f"{'Re-form' if session else 'Retry'} without the failed device"
        # No device advice for a failure that any device would repeat: the hint says to fix the code.
        devices = root is not None and not root.from_code
        for widget in (self.retry_device, self.retry_single, self.retry_without):
            widget.layout.display = "" if devices else "none"
        self.reform.layout.display = "" if reform else "none"
        self.retry_note.value = (f"<i>Re-form forms the session again on <code>{escape(', '.join(state.devices))}"
                                 "</code>: new ranks and a new process group; <b>the ranks' namespaces are lost</b> "
                                 "(what cells defined and what was pushed).</i>") if reform else ""
        self.retry_box.layout.display = "" if reform or (devices and not session) else "none"
        self.card_box.layout.display = ""

    @staticmethod
    def _cell_card(state: RunState) -> str:
        """A session's last failed cell: its card open while nothing ran after it, else folded
        under a line that names it (the cells after a failure are often the ones that look into it)."""
        failed = state.failed_cell
        assert failed is not None
        if failed is state.last_request and state.request is None:
            return cell_card_html(failed)
        return (f'<details class="ddp-last-failure"><summary style="color:{RED}">Last failure: '
                f"{escape(request_text(failed))}</summary>{cell_card_html(failed)}</details>")

    def _render_plot(self, state: RunState, now: float, force: bool) -> None:
        points = _plot_key(state)
        if not any(n or opened for n, opened in points) or points == self._plotted_points or (
                not force and now - self._plotted_at < PLOT_S):
            return
        self.plot.update(_loss_series(state))
        self._plotted_at, self._plotted_points = now, points

    # ---- actions --------------------------------------------------------------------------
    def _default_retry_device(self) -> str:
        healthy = self.run.state.healthy_devices
        return healthy[0] if healthy else self.run.state.devices[0]

    def _healthy_devices(self) -> list[str]:
        return self.run.state.healthy_devices

    def _retry(self, devices: Callable[[], list[str]]) -> None:
        if self.on_retry is None:
            return
        on_retry = self.on_retry

        session = self.run.state.origin == "session"
        said = io.StringIO()  # what forming a session again prints: said here, where it was clicked

        def begin() -> Any:
            chosen = devices()
            with contextlib.redirect_stderr(said) if session else contextlib.nullcontext():
                return on_retry(chosen) if chosen else None

        try:
            run, refused = self.retries.start(begin)
        except DDPNotebookError as e:
            failed = "Re-form failed: " if session else ""
            self.message.value = f'<span style="color:{RED}">{failed}{escape(str(e))}</span>'
            return
        if refused:
            self.message.value = f'<span style="color:{RED}">{escape(refused)}</span>'
        if run is None:
            return
        self.message.value = "" if not session else (
            f'<span class="ddp-reformed" style="color:#198754">{escape(said.getvalue().strip())}; its view is below.'
            "</span>")
        self.reform.disabled = self.retry_single.disabled = self.retry_without.disabled = True
        # On again once it ends (this view may no longer follow its own run, which has ended).
        run.subscribe(lambda event: self.refresh() if event.get("kind") == EventKind.RUN_FINISHED else None)
        if run.state.finished:  # it ended before it was subscribed to
            self.refresh()

    def _stop(self) -> None:
        if self.run.state.origin == "session":  # a cell run without blocking, not the session
            session = session_of(self.run)
            if session is None or not session.interrupt():
                self.message.value = "<i>Nothing to stop: no cell is running.</i>"
            self.refresh()
            return
        stop = getattr(self.run, "stop", None)
        if stop is not None:
            stop()
            self.refresh()

    def fallback_html(self) -> str:
        return self.forms.fallback_html()

    def status_key(self) -> tuple:
        return self.forms.status_key()

    def __repr__(self) -> str:
        return repr(self.forms)


def _main_epochs(state: RunState) -> tuple[Any, str]:
    """The main worker (whose records the table shows) and what its latest record is."""
    main = state.workers.get(0)
    if main is None or not main.epoch_history:
        return main, ""
    if not main.finished and not state.finished:
        return main, "running"
    if main.status != WorkerStatus.SUCCEEDED:
        return main, "cut short"
    return main, ""


class RunForms:
    """A run's static forms, which need no widget: its text (``repr``) and its HTML (the text,
    the loss plot as an image, the epoch table, the failure card), and what changes at a status
    change (``status_key``). The panel's view has them for what shows no widgets; a view kept in
    these forms alone (``ui="html"``, ``"text"``) is made of them."""

    def __init__(self, run: Any) -> None:
        self.run = run
        self._fallback_plot: tuple[Any, str] = (None, "")  # the HTML form's plot, and the points it shows

    def fallback_html(self) -> str:
        """The run as static HTML: its text view, its loss plot (an image), its epoch table, its
        failure card."""
        state: RunState = self.run.state
        main, last = _main_epochs(state)
        table = epoch_table_html(main.epoch_history, main.epochs, last) if main is not None else ""
        root = state.root_failure
        card = failure_card_html(root, state.failures, state.healthy_devices) if root is not None else ""
        if root is None and state.origin == "session" and state.failed_cell is not None:
            card = cell_card_html(state.failed_cell)
        points = _plot_key(state)
        if points != self._fallback_plot[0]:  # drawn again only when a point came (it is sent every second)
            series = {label: p for label, p in _loss_series(state).items() if p}
            self._fallback_plot = (points, f'<img class="ddp-fallback-plot" alt="loss by step" src="data:image/png;'
                                   f'base64,{base64.b64encode(plot_png(series, False, False)).decode()}">'
                                   if series else "")
        plot = self._fallback_plot[1]
        # Not redrawn as time passes: a session's request says since when it runs, not for how long.
        return (f'<div class="ddp-fallback"><pre>{escape(format_run(state, frozen=True))}</pre>{plot}{table}{card}'
                "</div>")

    def status_key(self) -> tuple:
        """What changes at a status change, and not at every report: the run's status, its
        workers', its failures and finished epochs (a display's fallback is sent again then)."""
        state: RunState = self.run.state
        main = state.workers.get(0)
        request, last = state.request, state.last_request  # (a session's)
        return (str(state.status), tuple(w.shown_status for w in state.workers.values()), len(state.failures),
                len(main.epoch_history) if main is not None else 0, state.stop_reason,
                request.what if request else None, (last.what, last.status) if last else None)

    def __repr__(self) -> str:
        return format_run(self.run.state)


def _plot_key(state: RunState) -> tuple:
    """What a loss plot shows changes with each closed bin and with the open one (the latest steps)."""
    return tuple((len(w.loss_history), w.loss_open) for w in state.workers.values())


def _loss_series(state: RunState) -> dict[str, list[tuple[float, float]]]:
    """Each rank's loss points, labelled as the plots label them."""
    return {f"rank {r} ({w.device})": w.loss_points for r, w in sorted(state.workers.items())}


def output_html(w: Any, shown: int = OUTPUT_SHOWN) -> str:
    """A rank's latest ``shown`` lines, under a line that says how many earlier ones are not shown
    and where they are (``run.output(rank)`` reads them from the run's log)."""
    lines = [text for _stream, text in w.output][-shown:]
    cut_off = w.output_lines - len(lines)
    lines_word = "line" if cut_off == 1 else "lines"
    note = (f'<div class="ddp-output-cut" style="color:#6c757d"><i>{cut_off:,} earlier {lines_word} not shown: '
            f"run.output({w.rank}) has them all</i></div>") if cut_off > 0 else ""
    return f"{note}<pre>{escape(chr(10).join(lines))}</pre>"


def tail_of(line: str, width: int) -> str:
    """The end of a long line (a progress bar's news is at its end), marked as cut."""
    return line if len(line) <= width else "…" + line[-(width - 1):]
