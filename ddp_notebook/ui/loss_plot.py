"""The loss plot of a run view: one line per rank, with a log scale and smoothing to keep a fast
run's noise and a long run's early drop readable.

>>> smooth([(1, 4.0), (2, 0.0), (3, 4.0), (4, 0.0)], weight=0.5)
[(1, 4.0), (2, 2.0), (3, 3.0), (4, 1.5)]
"""
from __future__ import annotations

import atexit
import functools
import gc
import io
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import ipywidgets as widgets

from .text import format_metric

__all__ = ["LossPlot", "smooth", "plot_png", "epoch_plot_png", "step_label"]

Series = Mapping[str, Sequence[tuple[float, float]]]  # label -> (step, loss) points
F = TypeVar("F", bound=Callable[..., Any])

# A view's thread may be drawing, or importing matplotlib, when the interpreter exits. Python
# then ends that thread with a forced unwind, and one through matplotlib's C++ (ft2font) aborts the
# process: "terminate called without an active exception" (exit 134), a segfault (139). Figures
# left for the cyclic collector are freed late in the exit, and ft2font's own objects then outlive
# the interpreter: "PyThreadState_Get: the function must be called with the GIL held" (134). So
# drawings take turns under one lock; at exit no drawing or import starts again, an import in
# progress and the drawing in progress, if any, are waited for, and matplotlib's garbage is
# collected on the exiting thread while the interpreter is whole. (The lock is given back: a
# view's thread waiting for it may hold its view's lock, which the run's end, written at exit, needs.)
_DRAWING = threading.Lock()
_exiting = False


def drawing(empty: Any) -> Callable[[F], F]:
    """Make a function that draws with matplotlib take its turn, and return ``empty`` at exit."""
    def wrap(draw: F) -> F:
        @functools.wraps(draw)
        def one_at_a_time(*args: Any, **kwargs: Any) -> Any:
            if _exiting:
                return empty
            # Imported before the turn is taken: a first import takes a second or more, which
            # the other drawers (and the threads that wait on them) would wait out.
            _import_matplotlib()
            with _DRAWING:
                return empty if _exiting else draw(*args, **kwargs)
        return one_at_a_time  # type: ignore[return-value]
    return wrap


def _import_matplotlib() -> None:
    """What a drawing needs of matplotlib, imported (the same modules wherever it is waited for)."""
    import matplotlib.backends.backend_agg
    import matplotlib.figure  # noqa: F401


@atexit.register
def _stop_drawing() -> None:
    global _exiting
    _exiting = True  # first: drawers that wait for the lock then give it up at once (it is not fair)
    if "matplotlib" in sys.modules:  # a drawer's import in progress is waited for (Python's import lock)
        _import_matplotlib()
    if _DRAWING.acquire(timeout=30):
        _DRAWING.release()
    gc.collect()


def smooth(points: Sequence[tuple[float, float]], weight: float) -> list[tuple[float, float]]:
    """An exponential moving average of the losses (TensorBoard's smoothing)."""
    out: list[tuple[float, float]] = []
    last = None
    for x, y in points:
        last = y if last is None else weight * last + (1 - weight) * y
        out.append((x, last))
    return out


def smoothing_weight(n: int) -> float:
    """More smoothing for more points: none below 20, about a 1% window past a few thousand."""
    return 0.0 if n < 20 else min(0.98, 1.0 - 10.0 / n) if n > 500 else 0.9


def step_label(x: float) -> str:
    """A step on the plot's axis as people read it.

    >>> step_label(0.0), step_label(25000.0), step_label(1_200_000.0), step_label(2.5)
    ('0', '25k', '1.2M', '2.5')
    """
    return format_metric(int(x)) if x == int(x) else f"{x:g}"


@drawing(b"")
def plot_png(series: Series, log_scale: bool, smoothed: bool) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    fig = Figure(figsize=(5.2, 2.2), dpi=100)
    ax = fig.add_subplot()
    for label, points in series.items():
        if not points:
            continue
        shown = smooth(points, smoothing_weight(len(points))) if smoothed else list(points)
        xs, ys = zip(*shown)
        # A line through one point draws nothing: a run that ended after its first report shows its point.
        ax.plot(xs, ys, label=label, linewidth=1.2, marker="o" if len(shown) < 3 else None, markersize=4)
    positive = all(y > 0 for points in series.values() for _x, y in points)
    if log_scale and positive:  # a log scale of a loss that reaches 0 or below would hide it
        ax.set_yscale("log")
    ax.set_xlabel("step")
    # Steps as people read them (25k, 1.2M), few enough not to run together at 100k steps.
    ax.xaxis.set_major_locator(MaxNLocator(nbins=6, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _pos: step_label(x)))
    ax.set_ylabel("loss" + (" (smoothed)" if smoothed else ""))
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


@drawing(b"")
def epoch_plot_png(train: Sequence[tuple[float, float]], valid: Sequence[tuple[float, float]]) -> bytes:
    """Train and valid loss per epoch (``(epoch, loss)`` points, epochs as the table counts them),
    as fastai's and Keras' progress draw them."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(4.2, 2.2), dpi=100)
    ax = fig.add_subplot()
    for label, points in (("train loss", train), ("valid loss", valid)):
        if points:
            xs, ys = zip(*points)
            ax.plot(xs, ys, label=label, linewidth=1.4, marker="o", markersize=3)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


class LossPlot(widgets.VBox):
    """The plot and its two switches; ``update(series)`` redraws it."""

    def __init__(self) -> None:
        self.image = widgets.Image(format="png", layout=widgets.Layout(width="520px"))
        self.log_scale = widgets.Checkbox(value=False, description="log scale", indent=False,
                                          layout=widgets.Layout(width="110px"))
        self.smoothed = widgets.Checkbox(value=False, description="smooth", indent=False,
                                         layout=widgets.Layout(width="90px"))
        super().__init__([self.image, widgets.HBox([self.log_scale, self.smoothed])],
                         layout=widgets.Layout(display="none"))
        self._series: Series = {}
        for box in (self.log_scale, self.smoothed):
            box.observe(lambda _change: self._draw(), names="value")

    def update(self, series: Series) -> None:
        self._series = series
        self._draw()

    def _draw(self) -> None:
        if not any(self._series.values()):
            return
        self.image.value = plot_png(self._series, self.log_scale.value, self.smoothed.value)
        self.layout.display = ""
