"""The live view of one run (ipywidgets 8): it renders the run's state and nothing else.

``RunView`` shows a header with Stop, one row per rank (status badge, progress bar,
step/epoch/loss/rate/elapsed, last output line), a loss plot, the failure card with its retry
buttons, and each rank's output. It needs only ``state`` and ``subscribe`` of what it shows: a
``Run``, or a ``core.stream.EventStream`` fed by hand (a log read from disk, a test).

Widget attributes are set from the refresher thread: ipywidgets sends those updates while a
cell runs, whereas button clicks wait until the kernel is idle, which is why launches return
at once.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from html import escape
from typing import Any, Optional

import ipywidgets as widgets

from ..core.errors import DDPNotebookError
from ..core.state import RunState, RunStatus
from .html import ORANGE, RED, badge, failure_card_html
from .loss_plot import LossPlot
from .text import format_data, format_duration, format_metric, format_rate, format_run

__all__ = ["RunView", "FullText"]

REFRESH_S = 0.25  # widget updates at most this often
TICK_S = 1.0  # and at least this often while the run goes on: the clock and silences move without events
PLOT_S = 1.0  # the loss plot is redrawn at most this often


class FullText:
    """ipywidgets cuts a widget's text/plain to 110 characters; ours is the run's text view,
    which nbval and text-only front ends read whole."""

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        data = super()._repr_mimebundle_(**kwargs)  # type: ignore[misc]
        data["text/plain"] = repr(self)
        return data


# One line, cut with an ellipsis at the column's width: the widget's own box does not clip.
NOWRAP = "white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:{width}"
TEXT_WIDTH = 420  # px, the row's text column


class _Row:
    """The widgets of one rank."""

    def __init__(self, rank: int, device: str, place: Optional[str] = None) -> None:
        where = f"<br><small>{escape(place)}</small>" if place else ""
        main = " <i>main</i>" if rank == 0 else ""
        self.name = widgets.HTML(f"<b>rank {rank}</b> <code>{escape(device)}</code>{main}{where}",
                                 layout=widgets.Layout(width="150px"))
        self.badge = widgets.HTML(layout=widgets.Layout(width="90px"))
        self.bar = widgets.FloatProgress(value=0.0, min=0.0, max=1.0, layout=widgets.Layout(width="180px"))
        self.text = widgets.HTML(layout=widgets.Layout(width=f"{TEXT_WIDTH}px", overflow="hidden"))
        self.last = widgets.HTML(layout=widgets.Layout(flex="1", min_width="0", overflow="hidden"))
        self.box = widgets.HBox([self.name, self.badge, self.bar, self.text, self.last],
                                layout=widgets.Layout(padding="2px", border="1px solid transparent"))


class RunView(FullText, widgets.VBox):
    """Live view of one run (a ``Run``, or anything with ``state`` and ``subscribe``).

    ``on_retry(devices) -> run`` is called by the card's retry buttons; the panel that owns the
    view shows the new run below it.
    """

    def __init__(self, run: Any, title: Optional[str] = None,
                 on_retry: Optional[Callable[[list[str]], Any]] = None, live: Optional[bool] = None) -> None:
        super().__init__()
        self.run = run
        self.on_retry = on_retry
        self.title = widgets.HTML()
        self.subtitle = title
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="warning",
                                          layout=widgets.Layout(width="90px"))
        self.stop_button.on_click(lambda _: self._stop())
        self.rows: dict[int, _Row] = {}
        self.rows_box = widgets.VBox()
        self.plot = LossPlot()
        self.card = widgets.HTML()
        self.retry_device = widgets.Dropdown(description="device", layout=widgets.Layout(width="200px"))
        self.retry_single = widgets.Button(description="Retry on single device", button_style="primary",
                                           icon="redo", layout=widgets.Layout(width="210px"))
        self.retry_without = widgets.Button(description="Retry without the failed device", icon="redo",
                                            layout=widgets.Layout(width="250px"))
        self.retry_single.on_click(lambda _: self._retry([self.retry_device.value]))
        self.retry_without.on_click(lambda _: self._retry(self._healthy_devices()))
        self.card_box = widgets.VBox([self.card, widgets.HBox([self.retry_device, self.retry_single,
                                                               self.retry_without])],
                                     layout=widgets.Layout(display="none"))
        self.outputs = widgets.Tab()
        self.output_box = widgets.Accordion(children=[self.outputs], titles=("Output per device",),
                                            selected_index=None)
        self.note = widgets.HTML()  # what the run is doing that the rows do not say (stopping, ...)
        self.message = widgets.HTML()  # the outcome of the user's last action here (a retry refused)
        self.children = [widgets.HBox([self.title, self.stop_button]), self.note, self.rows_box, self.plot,
                         self.card_box, self.message, self.output_box]
        self._dirty = threading.Event()
        self._plotted_at = 0.0
        self._plotted_points = -1
        self._lock = threading.Lock()
        run.subscribe(lambda _event: self._dirty.set())
        # Followed unless what was drawn is final: a run may end between the drawing and this
        # check (a forked run takes a tenth of a second), and its end would never be drawn.
        drawn_final = self.refresh()
        if live if live is not None else not drawn_final:
            threading.Thread(target=self._follow, name="ddp-panel", daemon=True).start()

    # ---- rendering -------------------------------------------------------------------------
    def _follow(self) -> None:
        while True:
            self._dirty.wait(TICK_S)
            self._dirty.clear()
            self.refresh()
            if getattr(self.run, "done", False) and self.run.state.finished:
                self.refresh(force_plot=True)
                return
            time.sleep(REFRESH_S)  # throttle: one redraw per period, however many events came

    def refresh(self, force_plot: bool = False) -> bool:
        """Bring every widget in line with the run state (thread-safe); whether the state drawn
        was the run's final one."""
        with self._lock:
            state: RunState = self.run.state
            final = state.finished  # before drawing: nothing changes once the run has finished
            now = time.time()
            end = state.ended_at or now
            elapsed = f"{end - state.started_at:.1f} s" if state.started_at else ""
            etas = [e for e in (w.eta() for w in state.workers.values()) if e is not None]
            if etas and not state.finished:
                elapsed += f" · ETA {format_duration(max(etas))}"
            # A retry says so, wherever it was started (the card, %ddp_retry, run.retry()).
            retry = f"retry of {state.parent} on {','.join(state.devices)}" if state.parent else ""
            subtitle = self.subtitle or retry
            sub = f" — {escape(subtitle)}" if subtitle else ""
            if state.data is not None and (not state.data.sending or not state.finished):
                elapsed += f" · {escape(format_data(state.data))}"
            if state.waiting_for is not None:
                elapsed += f" · starting workers ({escape(state.waiting_for)})"
            self.title.value = (f"<b>Run</b> <code>{escape(state.run_id)}</code>{sub} {badge(state.status)} "
                                f"on <code>{escape(','.join(state.devices))}</code> · {elapsed}")
            self.stop_button.layout.display = "none" if state.finished else ""
            if set(self.rows) != set(state.workers):
                self.rows = {r: _Row(r, w.device, w.place) for r, w in sorted(state.workers.items())}
                self.rows_box.children = self._grouped(state)
                self.outputs.children = [widgets.HTML() for _ in self.rows]
                for i, r in enumerate(self.rows):
                    self.outputs.set_title(i, f"rank {r} {state.workers[r].label}")
            failed_ranks = state.causing_ranks
            for r, row in self.rows.items():
                self._render_row(row, state.workers[r], r in failed_ranks, now)
            for i, r in enumerate(self.rows):
                lines = [text for _stream, text in state.workers[r].output][-200:]
                self.outputs.children[i].value = f"<pre>{escape(chr(10).join(lines))}</pre>"
            self._render_card(state)
            self.note.value = self._note(state)
            self._render_plot(state, now, force_plot)
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

    def _note(self, state: RunState) -> str:
        if state.supervisor_error is not None:
            return (f'<span style="color:{RED}">ddp_notebook\'s supervision of this run failed: '
                    f"{escape(state.supervisor_error)}</span>")
        stopping = state.stop_reason is not None or getattr(self.run, "stop_requested", False)
        if stopping and not state.finished:
            reason = f" ({escape(state.stop_reason)})" if state.stop_reason else ""
            return (f"<i>Stopping{reason}: each worker sees <code>ctx.should_stop</code> and may finish its step; "
                    "those still running after the grace period are ended.</i>")
        if state.status == RunStatus.STOPPED and state.stop_reason:
            return f"<i>Stopped: {escape(state.stop_reason)}.</i>"
        return ""

    def _render_row(self, row: _Row, w: Any, caused_failure: bool, now: float) -> None:
        row.badge.value = badge(w.shown_status, ORANGE if w.shown_status == "knock-on" else None)
        if w.total:
            row.bar.value = min(1.0, (w.step or 0) / w.total)
        elif w.status == "succeeded":
            row.bar.value = 1.0
        row.bar.bar_style = {"failed": "danger", "succeeded": "success", "stopped": "warning",
                             "knock-on": "warning"}.get(w.shown_status, "info")
        bits: list[str] = []
        if w.step is not None:
            bits.append(f"step {w.step}/{w.total}" if w.total else f"step {w.step}")
        if w.epoch is not None:
            bits.append(w.epoch_text)
        for key in ("loss", "samples_per_s"):
            if key in w.metrics:
                bits.append(f"{'samples/s' if key == 'samples_per_s' else key} {format_metric(w.metrics[key])}")
        bits += [f"{k} {format_metric(v)}" for k, v in w.metrics.items() if k not in ("loss", "samples_per_s")][:3]
        if w.status == "running" and format_rate(w):
            bits.append(format_rate(w))
        if w.started_at:
            bits.append(f"{(w.ended_at or now) - w.started_at:.0f} s")
        text = " · ".join(escape(bit) for bit in bits)  # metric names and values come from the run
        silent = w.silent_for(now)
        if silent is not None:
            text += f' · <b style="color:{ORANGE}">no progress for {format_duration(silent)}</b>'
        # One line per rank, however many metrics: what does not fit ends in an ellipsis.
        row.text.value = f'<div style="{NOWRAP.format(width=f"{TEXT_WIDTH - 8}px")}">{text}</div>'
        row.last.value = (f'<div style="{NOWRAP.format(width="100%")}"><code style="color:#6c757d">'
                          f"{escape(tail_of(w.last_line, 120))}</code></div>")
        row.box.layout.border = f"2px solid {RED}" if caused_failure else "1px solid transparent"
        if caused_failure:
            row.box.add_class("ddp-failed-row")  # a stable hook for styling and browser tests (added once)

    def _render_card(self, state: RunState) -> None:
        root = state.root_failure
        if root is None:
            self.card_box.layout.display = "none"
            return
        self.card.value = failure_card_html(root, state.failures, state.healthy_devices)
        options = list(state.devices)
        self.retry_device.options = options
        default = self._default_retry_device()
        if default in options and self.retry_device.value not in options:
            self.retry_device.value = default
        has_retry = self.on_retry is not None and state.finished
        self.retry_single.disabled = not has_retry
        self.retry_without.disabled = not has_retry or not self._healthy_devices()
        self.card_box.layout.display = ""

    def _render_plot(self, state: RunState, now: float, force: bool) -> None:
        points = sum(len(w.loss_history) for w in state.workers.values())
        if points == 0 or points == self._plotted_points or (not force and now - self._plotted_at < PLOT_S):
            return
        self.plot.update({f"rank {r} ({w.device})": list(w.loss_history) for r, w in sorted(state.workers.items())})
        self._plotted_at, self._plotted_points = now, points

    # ---- actions --------------------------------------------------------------------------
    def _default_retry_device(self) -> str:
        healthy = self.run.state.healthy_devices
        return healthy[0] if healthy else self.run.state.devices[0]

    def _healthy_devices(self) -> list[str]:
        return self.run.state.healthy_devices

    def _retry(self, devices: list[str]) -> None:
        if self.on_retry is None or not devices:
            return
        try:
            self.on_retry(devices)
            self.message.value = ""
        except DDPNotebookError as e:
            self.message.value = f'<span style="color:{RED}">{escape(str(e))}</span>'

    def _stop(self) -> None:
        stop = getattr(self.run, "stop", None)
        if stop is not None:
            stop()
            self.refresh()

    def __repr__(self) -> str:
        return format_run(self.run.state)


def tail_of(line: str, width: int) -> str:
    """The end of a long line (a progress bar's news is at its end), marked as cut."""
    return line if len(line) <= width else "…" + line[-(width - 1):]
