"""A run's live progress in a terminal or a log, for a caller that blocks on it.

On a TTY the block of lines (``format_run``) is redrawn in place, like a progress bar; elsewhere
(a pipe, a CI log) a line is printed when a rank changes: its status, its epoch or another tenth
of its steps. When the run ends, its final table is printed, outcome included.

>>> import io
>>> from ddp_notebook.core.state import RunState
>>> s = RunState()
>>> s.apply({"kind": "run_started", "time": 0.0, "run_id": "r1", "devices": ["cpu:0"], "backend": "gloo"})
>>> out = io.StringIO()
>>> lines = LineProgress(out)
>>> lines.update(s, now=0.0)
>>> s.apply({"kind": "ready", "time": 0.5, "rank": 0})
>>> s.apply({"kind": "progress", "time": 1.0, "rank": 0, "step": 5, "total": 10})
>>> lines.update(s, now=1.0); lines.update(s, now=1.5)
>>> print(out.getvalue(), end="")
rank 0 cpu:0 (main) starting
rank 0 cpu:0 (main) running    step 5/10 ( 50%)
"""
from __future__ import annotations

import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Optional

from ..core.state import RunState, WorkerState
from .text import format_run, format_worker

__all__ = ["LineProgress", "TerminalProgress", "watch"]

REDRAW_S = 0.5  # seconds between two redraws on a TTY


def _milestone(w: WorkerState) -> tuple[Any, ...]:
    """What a log line is printed for: a new status, another tenth of the steps, and a new epoch
    (another tenth of them, when there are more than 20)."""
    tenth = int(10 * (w.step or 0) / w.total) if w.total else None
    epoch = w.epoch
    if epoch is not None and w.epochs and w.epochs > 20:
        epoch = int(10 * epoch / w.epochs)
    return (w.status, epoch, tenth)


class LineProgress:
    """One line per change of a rank (for logs and pipes)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.seen: dict[int, tuple[Any, ...]] = {}

    def update(self, state: RunState, now: Optional[float] = None) -> None:
        for rank in sorted(state.workers):
            w = state.workers[rank]
            mark = _milestone(w)
            if self.seen.get(rank) != mark:
                self.seen[rank] = mark
                self.out.write(format_worker(w, now) + "\n")
        self.out.flush()

    def finish(self, state: RunState) -> None:
        self.out.write(format_run(state) + "\n")
        self.out.flush()


class TerminalProgress:
    """The run's lines, redrawn in place (ANSI: cursor up, clear line)."""

    def __init__(self, out: IO[str]) -> None:
        self.out = out
        self.drawn = 0

    def _draw(self, text: str) -> None:
        # A line longer than the terminal wraps, and going back up would miss part of the block.
        width = max(20, shutil.get_terminal_size((200, 24)).columns - 1)
        lines = [line[:width] for line in text.split("\n")]
        up = f"\x1b[{self.drawn}F" if self.drawn else ""
        self.out.write(up + "".join(f"\x1b[2K{line}\n" for line in lines))
        self.out.flush()
        self.drawn = len(lines)

    def update(self, state: RunState, now: Optional[float] = None) -> None:
        self._draw(format_run(state, now))

    def finish(self, state: RunState) -> None:
        self._draw(format_run(state))


def watch(run: Any, out: Optional[IO[str]] = None) -> Callable[[], None]:
    """Show ``run``'s progress on ``out`` (default stderr, as tqdm does: stdout stays the
    program's) until it ends, from a thread; returns a function that waits for that thread and
    prints the final table (call it once the run has ended). In place on a TTY, one line per
    change elsewhere."""
    stream = out or sys.stderr
    tty = bool(getattr(stream, "isatty", lambda: False)())
    view: Any = TerminalProgress(stream) if tty else LineProgress(stream)
    changed = threading.Event()
    run.subscribe(lambda _event: changed.set())

    def loop() -> None:
        while not run.done:
            changed.wait(REDRAW_S if tty else 5.0)  # a TTY's clock ticks; a log hears of changes
            changed.clear()
            if not run.done:
                view.update(run.state, time.time())

    thread = threading.Thread(target=loop, name=f"ddp-progress-{run.id}", daemon=True)
    thread.start()

    def finish() -> None:
        # After an interrupt the run is still stopping: the table shows how it ended (its stop
        # and kill grace periods bound the wait).
        options = getattr(run, "options", None)
        limit = (options.stop_grace + options.kill_grace if options is not None else 0.0) + 30.0
        deadline = time.monotonic() + limit
        while not run.done and time.monotonic() < deadline:
            changed.wait(0.5)
            changed.clear()
        changed.set()
        thread.join(timeout=10)
        view.finish(run.state)
        restarted = getattr(run, "restarted", None)
        if restarted is not None:  # it failed and started again (max_restarts): each attempt's table
            watch(restarted, stream)()

    return finish
