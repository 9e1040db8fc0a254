"""Runs side by side: ``compare(*runs)`` returns a ``Comparison``, which shows as overlaid curves
(one plot per metric, one line per run, the runs' names in the legend) above a table (one row
per run: name, status, duration, devices, the config values that differ between the runs, with
the equal ones folded away, and the final and best metrics); ``frame()`` is the same as a pandas
DataFrame, in the shape ``mlflow.search_runs`` returns.

In a notebook a comparison holding a run that goes on updates in place as it trains (a display
id, as IPython's ``update_display``); elsewhere it prints its table.
"""
from __future__ import annotations

import base64
import io
import math
import threading
import time
from collections.abc import Sequence
from html import escape
from typing import Any, Optional

from ..core.console import one_line
from ..core.errors import ArgumentsError, RunLoadError, UnsafeRunDirError
from ..core.events import EventKind
from ..core.experiment import differing
from ..core.state import RunState
from ..lifecycle.experiments import LISTED_ORIGINS, ListedRun, find_runs, runs_of_here
from ..lifecycle.options import ui_form
from .display import updater
from .html import badge
from .loss_plot import drawing
from .text import format_duration, format_metric

__all__ = ["compare", "Comparison", "PLOTS_SHOWN", "REFRESH_S", "DRAW_SHARE"]

PLOTS_SHOWN = 6
"""Metrics plotted when none are named (the first ones logged: losses first)."""
REFRESH_S = 2.0
"""Seconds between two redraws of a comparison holding a live run, at least."""
DRAW_SHARE = 0.05
"""Of a core, what the redraws of a live comparison take at most: one of many runs (a redraw of
200 runs costs about half a second) waits longer between redraws, leaving the ranks their CPU."""
NOT_PLOTTED = ("samples_per_s",)  # (a rate, not a result: plotted only when named)
FIRST = ("loss", "train_loss", "valid_loss", "val_loss")
DRAWN_POINTS = 400  # per line: about the width of a plot in pixels
LEGEND_RUNS = 20  # runs the legend names at most (past it, the best by the first metric)
OWN_COLUMNS = ("devices", "function")  # config entries with a column of their own, or none to show


def compare(*runs: Any, metrics: Optional[Sequence[str]] = None, last: Optional[int] = None,
            everywhere: bool = False, ui: Optional[str] = None) -> Comparison:
    """Compare runs: their curves overlaid, their configs' differences and their final metrics.

    Parameters
    ----------
    *runs : Run or str
        Runs, run ids, or unique ends of ids (``"5266c4"``). None: the runs launched from this
        notebook's working directory (every run on disk with ``everywhere``), oldest first.
    metrics : list of str, optional
        The metrics to plot (default: up to six that rank 0 logged, losses first; a rate such as
        ``samples_per_s`` only when named).
    last : int, optional
        Only the last ``last`` runs (of those given, or found).
    everywhere : bool, default False
        Without ``runs``: every run of the runs folder, whichever notebook launched it.
    ui : str, optional
        How it shows: ``"html"`` (its curves and table; ``"widget"`` and the default are the same:
        a comparison is no widget) or ``"text"`` (its table as text alone). Default
        ``$DDP_NOTEBOOK_UI``, else HTML.

    Returns
    -------
    Comparison
        Shows itself (live while a run goes on); ``frame()`` gives a pandas DataFrame.

    Raises
    ------
    RunLoadError
        A run id that no run has, or an end of id that several runs share.
    ArgumentsError
        A metric that none of the runs logged (the message lists those they did), or ``last``
        that is not a whole number >= 1.
    LaunchOptionError
        ``ui`` (or ``$DDP_NOTEBOOK_UI``) is not one of ``"widget"``, ``"html"``, ``"text"``.

    Examples
    --------
    ::

        runs = [ddp_notebook.fit(model(), data, loss, optimizer=sgd(lr), epochs=5, name=f"lr={lr}",
                                 wait=False) for lr in (0.1, 0.01)]
        ddp_notebook.compare(*runs)            # curves, then the table: lr differs
        ddp_notebook.compare(last=4).frame()   # the last 4 runs of this folder, as a DataFrame
    """
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 1):
        raise ArgumentsError(f"last must be a whole number >= 1 (how many of the latest runs), not {last!r}")
    if not isinstance(everywhere, bool):
        raise ArgumentsError(f"everywhere must be True or False, not {everywhere!r}")
    if metrics is not None:
        asked = list(metrics) if not isinstance(metrics, str) and hasattr(metrics, "__iter__") else None
        if asked is None or not all(isinstance(m, str) for m in asked):
            raise ArgumentsError(f"metrics is a list of metric names, such as ['valid_loss'], not {metrics!r}")
        metrics = list(dict.fromkeys(asked))  # (a metric named twice: one column)
    if runs:  # the runs named: each one must be read, and is shown once however often it is named
        listed, unreadable = list({one.id: one for one in find_runs(runs)}.values()), list[str]()
        for one in listed:
            one.state  # noqa: B018 - read now: a run that cannot be read is said here, by id
    else:  # the runs found: one that cannot be read is left out, and said
        listed, unreadable = _readable(runs_of_here(everywhere, origins=LISTED_ORIGINS))
    if last is not None:
        listed = listed[-last:]
    return Comparison(listed, list(metrics) if metrics is not None else None, unreadable,
                      text_only=ui_form(ui) == "text")


def _readable(listed: list[ListedRun]) -> tuple[list[ListedRun], list[str]]:
    """The runs whose logs can be read, and a line for each one that cannot."""
    readable, unreadable = [], []
    for one in listed:
        try:
            one.state  # noqa: B018 - (read once, kept)
        except (RunLoadError, UnsafeRunDirError) as e:
            unreadable.append(f"{one.id}: {e}")
        else:
            readable.append(one)
    return readable, unreadable


def _label(state: RunState) -> str:
    return state.name or state.run_id


class Comparison:
    """Runs side by side (made by :func:`ddp_notebook.compare`): in a notebook their curves above a
    table, live while a run goes on; ``frame()``, a pandas DataFrame; ``repr()``, the table as text."""

    def __init__(self, listed: list[ListedRun], metrics: Optional[list[str]] = None,
                 unreadable: Sequence[str] = (), text_only: bool = False) -> None:
        self._listed = listed
        self._asked = metrics
        #: Shown as its text alone (``compare(..., ui="text")``), not its curves and table.
        self.text_only = text_only
        #: A line for each run of the folder whose log could not be read (left out).
        self.unreadable = list(unreadable)
        if metrics is not None:
            logged = self._logged()
            missing = [m for m in metrics if m not in logged]
            if missing:
                said = ", ".join(logged) if logged else "nothing yet"
                raise ArgumentsError(f"no run of this comparison logged {', '.join(map(repr, missing))}: they logged "
                                     f"{said}")

    # ---- what it holds ---------------------------------------------------------------------------
    @property
    def run_ids(self) -> list[str]:
        """The ids of the runs compared, in order."""
        return [r.id for r in self._listed]

    @property
    def states(self) -> list[RunState]:
        """Each run's state as it is now."""
        return [r.state for r in self._listed]

    @property
    def live(self) -> bool:
        """Whether a run of the comparison goes on in this kernel (it updates)."""
        return any(r.live for r in self._listed)

    def _logged(self) -> list[str]:
        names: list[str] = []
        for state in self.states:
            names += [n for n in state.series if n not in names]
        return sorted(names, key=lambda n: (FIRST.index(n) if n in FIRST else len(FIRST), names.index(n)))

    @property
    def metrics(self) -> list[str]:
        """The metrics plotted: those asked, else up to ``PLOTS_SHOWN`` logged (losses first)."""
        if self._asked is not None:
            return list(self._asked)
        logged = self._logged()
        return [n for n in logged if n not in NOT_PLOTTED][:PLOTS_SHOWN]

    def labels(self, states: Optional[list[RunState]] = None) -> list[str]:
        """How each run is named: its name, else its id; a name two runs share, with the id's end."""
        states = self.states if states is None else states
        names = [_label(s) for s in states]
        return [f"{n} ({s.run_id[-6:]})" if s.name and names.count(n) > 1 else n for n, s in zip(names, states)]

    def differences(self, states: Optional[list[RunState]] = None) -> tuple[list[str], dict[str, Any]]:
        """The config keys whose values differ between the runs, and those the same in all (with
        their value)."""
        states = self.states if states is None else states
        configs = [s.config for s in states]
        keys = [k for k in differing(configs) if k not in OWN_COLUMNS]
        same = {k: v for k, v in (configs[0] if configs else {}).items() if k not in keys and k not in OWN_COLUMNS
                and all(k in c for c in configs)}
        return keys, same

    def rows(self) -> list[dict[str, Any]]:
        """The table as data, one dict per run: ``run`` (its label), ``run_id``, ``status``,
        ``duration`` (seconds), ``devices``; ``config``, the config values that differ between
        the runs (a value a run lacks is left out); ``metrics``, each plotted metric's last value
        and the monitored value's best (``valid_loss.min``)."""
        return self._rows(self.states)

    def _rows(self, states: list[RunState]) -> list[dict[str, Any]]:
        keys, _ = self.differences(states)
        plotted = self.metrics
        out = []
        for label, state in zip(self.labels(states), states):
            end = state.ended_at or time.time()
            metrics = state.metrics
            out.append({"run": label, "run_id": state.run_id, "status": str(state.status),
                        "duration": end - state.started_at if state.started_at else None,
                        "devices": ",".join(state.devices),
                        "config": {k: state.config[k] for k in keys if k in state.config},
                        "metrics": {**{m: metrics[m] for m in plotted if m in metrics},
                                    **{k: v for k, v in metrics.items() if k.endswith((".min", ".max"))}}})
        return out

    # ---- pandas ----------------------------------------------------------------------------------
    def frame(self) -> Any:
        """The runs as a pandas DataFrame, one row per run, in the shape ``mlflow.search_runs``
        returns: ``run_id``, ``name``, ``status``, ``start_time``, ``end_time`` (UTC), then
        ``config.*`` (MLflow's ``params.*``; values keep their types), ``tags.*`` and ``metrics.*``
        (``Run.metrics``); a value a run lacks is missing (NaN or None).

        Returns
        -------
        pandas.DataFrame

        Raises
        ------
        ImportError
            pandas is not installed (``pip install pandas``).
        """
        try:
            import pandas as pd
        except ImportError as e:
            raise ImportError("Comparison.frame() needs pandas: pip install pandas (or ddp_notebook[experiments])") \
                from e
        records = []
        for state in self.states:
            record: dict[str, Any] = {
                "run_id": state.run_id, "name": state.name, "status": str(state.status),
                "start_time": pd.Timestamp(state.started_at, unit="s", tz="UTC") if state.started_at else pd.NaT,
                "end_time": pd.Timestamp(state.ended_at, unit="s", tz="UTC") if state.ended_at else pd.NaT}
            record.update({f"config.{k}": v for k, v in state.config.items()})
            record.update({f"tags.{k}": v for k, v in state.tags.items()})
            record.update({f"metrics.{k}": v for k, v in state.metrics.items()})
            records.append(record)
        columns = ["run_id", "name", "status", "start_time", "end_time"]
        for prefix in ("config.", "tags.", "metrics."):
            for record in records:
                columns += [k for k in record if k.startswith(prefix) and k not in columns]
        return pd.DataFrame.from_records(records, columns=columns)

    # ---- showing it ------------------------------------------------------------------------------
    @drawing(None)
    def plot_png(self) -> Optional[bytes]:
        """The curves as a PNG: one plot per metric, one line per run (None when no run logged any)."""
        metrics = self.metrics
        states = self.states
        if not metrics or not any(s.series for s in states):
            return None
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        cols = min(len(metrics), 3)
        rows = -(-len(metrics) // cols)
        labels = self.labels(states)
        shown, title = self._legend(labels, states, metrics[0])
        height = 2.7 * rows
        fit = max(4, int(height * 72 / 12) - 2)  # legend entries a column holds (8 pt type)
        ncols = -(-len(shown) // fit)
        width, legend = 4.2 * cols, 0.3 + 1.8 * ncols
        fig = Figure(figsize=(width + legend, height), dpi=96)
        axes = fig.subplots(rows, cols, squeeze=False)
        right, top = (width - 0.1) / (width + legend), 1 - 0.35 / height
        fig.subplots_adjust(left=0.6 / (width + legend), right=right, bottom=0.5 / height, top=top, wspace=0.28,
                            hspace=0.55)
        colors = _colors(len(states))
        handles: dict[str, Any] = {}
        for i, metric in enumerate(metrics):
            ax = axes[i // cols][i % cols]
            # A value logged once an epoch (fit's valid_loss, an accuracy) is drawn by epoch, counted
            # from 1 as the panel does; a value logged every step, by step.
            by_epoch = all(_per_epoch(state, metric) for state in states if state.series.get(metric))
            for color, label, state in zip(colors, labels, states):
                points = state.series.get(metric)
                if not points:
                    continue
                if by_epoch:
                    xs = [float(e + 1) for e in state.series_epochs[metric] if e is not None]
                else:
                    xs = [x for x, _ in points]
                ys = [y for _, y in points]
                if len(xs) > DRAWN_POINTS:  # no more than a plot's width can show
                    every = -(-len(xs) // DRAWN_POINTS)
                    xs, ys = xs[::every] + xs[-1:], ys[::every] + ys[-1:]
                (line,) = ax.plot(xs, ys, color=color, linewidth=1.2, marker="o" if len(points) <= 30 else None,
                                  markersize=3)
                handles.setdefault(label, line)
            ax.set_title(_plain_text(metric), fontsize=10)
            ax.set_xlabel("epoch" if by_epoch else "step", fontsize=9)
            ax.tick_params(labelsize=8)
            ax.xaxis.get_major_locator().set_params(integer=True, nbins=6)
        for j in range(len(metrics), rows * cols):
            axes[j // cols][j % cols].set_visible(False)
        if handles:
            fig.legend([handles[label] for label in shown if label in handles],
                       [_plain_text(s) for s in shown if s in handles],
                       loc="upper left", bbox_to_anchor=(right + 0.01, top + 0.02), fontsize=8, frameon=False,
                       title=title and _plain_text(title), title_fontsize=8, alignment="left", ncols=ncols)
        buf = io.BytesIO()
        FigureCanvasAgg(fig).print_png(buf)
        return buf.getvalue()

    def _legend(self, labels: list[str], states: list[RunState], metric: str) -> tuple[list[str], Optional[str]]:
        """The runs the legend names: all of them, up to ``LEGEND_RUNS``; past that, the best by
        the last value of the first metric plotted (lower is better unless it is monitored as max)."""
        if len(labels) <= LEGEND_RUNS:
            return labels, None
        def last(state: RunState) -> float:
            points = state.series.get(metric)
            if not points:
                return math.inf
            higher = state.monitor == metric and state.monitor_mode == "max"
            return -points[-1][1] if higher else points[-1][1]
        ranked = sorted(range(len(labels)), key=lambda i: last(states[i]))[:LEGEND_RUNS]
        return [labels[i] for i in sorted(ranked)], f"the {LEGEND_RUNS} best of {len(labels)} by {metric}"

    def _cells(self, states: list[RunState]) -> tuple[list[str], list[list[str]], dict[str, Any]]:
        """The table's header and rows as text, and the config the runs share, from one look at
        the runs' states (the text and the HTML of one display say the same)."""
        keys, same = self.differences(states)
        rows = self._rows(states)
        plotted = self.metrics
        bests = list(dict.fromkeys(k for r in rows for k in r["metrics"] if k.endswith((".min", ".max"))))
        # A config entry named as a metric (fit's loss function, and the loss logged) says which it is.
        head = [one_line(h) for h in ["run", "status", "duration", "devices",  # names as a rank wrote them: one line
                                      *[f"{k} (config)" if k in plotted or k in bests else k for k in keys],
                                      *plotted, *bests]]
        body = []
        for row in rows:
            config, metrics = row["config"], row["metrics"]
            body.append([row["run"], row["status"], _seconds_text(row["duration"]), row["devices"],
                         *[_value_text(config.get(k), k in config) for k in keys],
                         *[_value_text(metrics.get(m), m in metrics) for m in plotted + bests]])
        return head, body, same

    def html(self) -> str:
        """The comparison as HTML: the curves (a PNG inside), the table, the shared config folded."""
        return self._html(self.states)

    def _html(self, states: list[RunState]) -> str:
        png = self.plot_png()
        head, body, same = self._cells(states)
        image = (f'<img class="ddp-compare-plot" style="max-width:100%" src="data:image/png;base64,'
                 f'{base64.b64encode(png).decode()}"/>' if png else "")
        cell = 'style="padding:1px 8px;text-align:left;white-space:nowrap"'
        ids = [s.run_id for s in states]
        rows = [f"<tr>{''.join(f'<th {cell}>{escape(h)}</th>' for h in head)}</tr>"]
        for run_id, cells in zip(ids, body):
            shown = [f'<td {cell} title="{escape(run_id)}"><b>{escape(cells[0])}</b></td>',
                     f"<td {cell}>{badge(cells[1])}</td>"]
            shown += [f"<td {cell}>{escape(c)}</td>" for c in cells[2:]]
            rows.append(f"<tr>{''.join(shown)}</tr>")
        table = f'<table class="ddp-compare" style="border-collapse:collapse;font-size:12px">{"".join(rows)}</table>'
        folded = ""
        if same:
            items = "".join(f"<li><code>{escape(one_line(k))}</code> = <code>{escape(_value_text(v, True))}</code></li>"
                            for k, v in same.items())
            folded = (f"<details><summary>The same in every run: {len(same)} config value"
                      f"{'' if len(same) == 1 else 's'}</summary><ul>{items}</ul></details>")
        left_out = ""
        if self.unreadable:
            items = "".join(f"<li>{escape(line)}</li>" for line in self.unreadable)
            left_out = (f'<details><summary style="color:#fd7e14">{len(self.unreadable)} run'
                        f"{'' if len(self.unreadable) == 1 else 's'} of the folder left out: "
                        f"{'its log' if len(self.unreadable) == 1 else 'their logs'} cannot be read</summary>"
                        f"<ul>{items}</ul></details>")
        live = " · <i>live: updates as the runs train</i>" if any(not s.finished for s in states) and self.live else ""
        title = f"<b>{len(ids)} run{'' if len(ids) == 1 else 's'} compared</b>{live}"
        empty = "" if ids else "<p>No run to compare: launch runs from this notebook, or give runs or their ids.</p>"
        return f'<div class="ddp-comparison">{title}{empty}{image}{table}{folded}{left_out}</div>'

    def __repr__(self) -> str:
        return self._text(self.states)

    def _text(self, states: list[RunState]) -> str:
        head, body, same = self._cells(states)
        lines = []
        if body:
            widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
            lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)).rstrip())
            lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in body]
        else:
            lines.append("Comparison of no run (launch runs from this notebook, or give runs or their ids)")
        if same:
            lines.append("the same in every run: " + ", ".join(f"{one_line(k)}={_value_text(v, True)}"
                                                               for k, v in same.items()))
        lines += [f"left out, its log cannot be read: {line}" for line in self.unreadable]
        return "\n".join(lines)

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, str]:
        states = self.states
        if self.text_only:
            return {"text/plain": self._text(states)}
        return {"text/plain": self._text(states), "text/html": self._html(states)}

    def _ipython_display_(self) -> None:
        """Shown with a display id, in the cell that showed it (whatever cell runs then): redrawn
        every ``REFRESH_S`` while a run goes on (less often when a redraw would take more than
        ``DRAW_SHARE`` of a core), and as each run ends, before its ``wait()``
        returns (a notebook executed without a front end keeps the final state)."""
        from IPython.display import display

        handle = display(self._repr_mimebundle_(), raw=True, display_id=True)
        if handle is None or not self.live:
            return
        update = updater(handle)  # (in the cell that showed it; what did not change is not sent again)
        drawing = threading.Lock()

        def redraw(final: bool = False) -> None:
            with drawing:  # one at a time, each showing the state as it is then
                update(self._repr_mimebundle_(), {}, final)

        def on_event(event: dict[str, Any]) -> None:
            if event.get("kind") == EventKind.RUN_FINISHED:
                redraw(final=True)

        for listed in self._listed:
            if listed.live and listed.run is not None:
                listed.run.subscribe(on_event)
        if not self.live:  # every run ended before it was subscribed to: its end is drawn here
            redraw(final=True)

        def follow() -> None:
            pause = REFRESH_S
            while self.live:
                time.sleep(pause)
                if self.live:
                    used = time.thread_time()
                    redraw()
                    pause = max(REFRESH_S, (time.thread_time() - used) / DRAW_SHARE)

        threading.Thread(target=follow, name="ddp-compare", daemon=True).start()


def _plain_text(text: str) -> str:
    """``text`` as matplotlib draws it as written: a ``$`` would start its math notation (and an
    unbalanced one fail the whole plot), on one line without escape sequences."""
    return one_line(text).replace("$", r"\$")


def _per_epoch(state: RunState, metric: str) -> bool:
    """Whether ``metric`` was logged once an epoch at most, each time in one (a per-epoch value)."""
    epochs = state.series_epochs.get(metric) or []
    return bool(epochs) and None not in epochs and len(set(epochs)) == len(epochs)


def _seconds_text(seconds: Optional[float]) -> str:
    """A run's length: tenths of a second under ten seconds (a quick run is not "0 s")."""
    if seconds is None:
        return ""
    return f"{seconds:.1f} s" if seconds < 10 else format_duration(seconds)


def _value_text(value: Any, present: bool) -> str:
    if not present:
        return "—"
    if isinstance(value, float):
        return format_metric(value)
    return one_line(str(value))


def _colors(n: int) -> list[Any]:
    """One color per run: the default cycle up to 10, then spread over a colormap."""
    from matplotlib import colormaps

    if n <= 10:
        return [f"C{i}" for i in range(n)]
    cmap = colormaps["tab20" if n <= 20 else "viridis"]
    return [cmap(i / max(n - 1, 1)) if n > 20 else cmap(i) for i in range(n)]
