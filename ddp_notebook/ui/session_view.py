"""The live view of a session (ipywidgets 8): it renders ``Session.state`` and nothing else.

A header (the session, its status and devices), one row per rank (rank,
device and pid, a state badge — idle, running, finished, failed, ended —, what it runs and for
how long, on a clock that ticks, and the last line it printed), what runs now or how the last
request ended, the failure card of a failed cell (the same as a run's, with the failed rank's
locals) or of the rank failure that ended the session, Re-form once it has ended, and each rank's
output.

Stop shows while a cell runs without blocking (``%%ddp --noblock``): the kernel is free, so the
click is handled at once and interrupts the cell on every rank. A blocking ``%%ddp`` cell holds
the kernel's main thread, where a click would be handled only once the cell had ended: while one
runs, the view says what stops it (Kernel → Interrupt, which reaches every rank). Re-form runs
``session.restart()`` in the click's handler, once the cell that saw the session end has
returned.
"""
from __future__ import annotations

import contextlib
import io
import threading
import time
import uuid
import weakref
from collections.abc import Callable
from html import escape
from typing import Any, Optional

import ipywidgets as widgets

from ..core.errors import DDPNotebookError
from ..core.failures import WorkerFailure
from ..lifecycle.session_state import Outcome, RankState, SessionState, format_session, ranks_text, seconds_text
from .html import ORANGE, RED, badge, failure_card_html, hint_for, liveness_html
from .run_view import (
    BADGE_WIDTH,
    NAME_WIDTH,
    REFRESH_S,
    TICK_S,
    WRAP,
    FullText,
    StartGuard,
    last_output,
    one_line,
    tail_of,
)

__all__ = ["SessionView", "show_session", "STATUS_COLORS"]

GREEN, BLUE, GREY, DARK = "#198754", "#0d6efd", "#6c757d", "#495057"
#: The badge colour of each session and rank status.
STATUS_COLORS = {"forming": GREY, "ready": GREEN, "idle": GREEN, "running": BLUE, "finished": "#0aa2c0",
                 "failed": RED, "ended": DARK, "closed": GREY}
OUTCOME_COLORS = {"ok": GREEN, "failed": RED, "interrupted": ORANGE, "ended": RED}
DOING_WIDTH = 230  # px: what the rank runs and its clock
OUTPUT_LINES_SHOWN = 20


class _RankRow:
    """The widgets of one rank: a line of fixed columns, and a note below when there is one."""

    def __init__(self, rank: RankState) -> None:
        main = " <i>main</i>" if rank.rank == 0 else ""
        self.name = widgets.HTML(one_line(f"<b>rank {rank.rank}</b> <code>{escape(rank.device)}</code>{main}",
                                          f"rank {rank.rank} {rank.device}"),
                                 layout=widgets.Layout(width=f"{NAME_WIDTH}px", flex="0 0 auto"))
        self.badge = widgets.HTML(layout=widgets.Layout(width=f"{BADGE_WIDTH}px", flex="0 0 auto"))
        self.doing = widgets.HTML(layout=widgets.Layout(width=f"{DOING_WIDTH}px", flex="0 0 auto"))
        self.last = widgets.HTML(layout=widgets.Layout(flex="1 1 0", min_width="0"))
        self.note = widgets.HTML(layout=widgets.Layout(margin=f"-4px 0 0 {NAME_WIDTH + 4}px", min_width="0",
                                                      height="auto"))
        for widget, name in ((self.doing, "ddp-doing"), (self.note, "ddp-note"), (self.last, "ddp-last"),
                             (self.badge, "ddp-rank-status")):
            widget.add_class(name)  # stable hooks for browser tests
        line = widgets.HBox([self.name, self.badge, self.doing, self.last],
                            layout=widgets.Layout(flex_flow="row nowrap", align_items="center"))
        self.box = widgets.VBox([line, self.note], layout=widgets.Layout(padding="1px 2px",
                                                                        border="1px solid transparent"))
        self.box.add_class("ddp-session-rank")

    def render(self, rank: RankState, now: float) -> None:
        self.badge.value = badge(rank.status, STATUS_COLORS.get(rank.status))
        clock = rank.clock(now)
        if rank.status == "running":
            doing = f"{rank.doing} · {clock}"
        elif rank.status == "finished":
            doing = f"{rank.doing} done in {clock} · waits"
        elif rank.doing and clock:
            doing = f"last: {rank.doing} · {clock}"
        else:
            doing = ""
        text = " · ".join(bit for bit in (doing, f"pid {rank.pid}" if rank.pid else "") if bit)
        self.doing.value = one_line(escape(text), text)
        stream, line, _warnings = last_output(rank.output)
        color = RED if stream == "stderr" else GREY
        self.last.value = one_line(f'<code style="color:{color}">{escape(tail_of(line, 160))}</code>', line[-500:])
        failed = rank.status == "failed"
        color = RED if failed else ORANGE if rank.note == "interrupted" else GREY
        self.note.value = (f'<div style="{WRAP};color:{color}">{escape(rank.note)}</div>' if rank.note else "")
        self.box.layout.border = f"2px solid {RED}" if failed else "1px solid transparent"


class SessionView(FullText, widgets.VBox):
    """Live view of a session (anything with ``state``, ``subscribe``, ``interrupt`` and
    ``restart``, as :class:`ddp_notebook.Session` has).

    ``on_reform(session)`` hears of a Re-form done here (the magics make the notebook's
    ``_ddp_run`` follow the new run). Re-form forms the session once per click sequence.
    """

    def __init__(self, session: Any, on_reform: Optional[Callable[[Any], None]] = None,
                 live: bool = True) -> None:
        super().__init__()
        self.session = session
        self.on_reform = on_reform
        self.reforms = StartGuard("re-forming it again")
        self.token = uuid.uuid4().hex[:12]  # this view's own class (liveness_html)
        self.add_class("ddp-session-view")
        self.add_class(f"ddp-view-{self.token}")
        self.title = widgets.HTML(layout=widgets.Layout(min_width="0", flex="0 1 auto"))
        self.live = widgets.HTML(layout=widgets.Layout(flex="0 0 auto"))
        self.rows: dict[int, _RankRow] = {}
        self.rows_box = widgets.VBox()
        self.activity = widgets.HTML()  # what runs now, or how the last request ended
        self.activity.add_class("ddp-activity")
        self.card = widgets.HTML()
        self.reform_button = widgets.Button(description="Re-form", icon="redo", button_style="primary",
                                            layout=widgets.Layout(width="110px", flex="0 0 auto"))
        self.reform_note = widgets.HTML(layout=widgets.Layout(min_width="0", flex="1 1 auto"))
        self.reform_box = widgets.HBox([self.reform_button, self.reform_note],
                                       layout=widgets.Layout(align_items="center", display="none"))
        # Stop: for a cell run without blocking (a blocking cell holds the kernel, so a click would
        # reach it only once the cell had ended: Kernel → Interrupt stops that one).
        self.stop_button = widgets.Button(description="Stop", icon="stop", button_style="danger",
                                          tooltip="interrupt the cell on every rank (the session goes on)",
                                          layout=widgets.Layout(width="90px", display="none"))
        self.stop_button.add_class("ddp-session-stop")
        self.message = widgets.HTML()  # the outcome of the user's last action here, until the next request
        self._message_at = 0.0
        self.outputs = widgets.Tab()
        self.output_box = widgets.Accordion(children=[self.outputs], titles=("Output per rank",),
                                            selected_index=None)
        header = widgets.HBox([self.title, self.live],
                              layout=widgets.Layout(align_items="center", flex_flow="row nowrap"))
        for dimmed in (self.title, self.rows_box):
            dimmed.add_class("ddp-dims")  # what a view no longer updated dims (liveness_html)
        self.children = [header, self.rows_box, self.activity, self.stop_button, self.card, self.reform_box,
                         self.message, self.output_box]
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._tick = 0
        self._update: Optional[Callable[[Any], None]] = None
        self._shown_key: Any = None
        self._update_lock = threading.Lock()
        self.reform_button.on_click(lambda _: self.reform())
        self.stop_button.on_click(lambda _: self.stop())
        # A thread follows the session only while something moves (its clock ticks while it is
        # forming, ready or running); it ends when the session has ended or closed (a later
        # change, a restart, starts one again) and when the view is closed. The session holds
        # the view weakly: a view never keeps a session alive, nor the other way round.
        self._live = live
        self._following = False
        self._view_closed = False
        self._follow_lock = threading.Lock()
        mine = weakref.ref(self)
        session.subscribe(lambda: (lambda view: view._changed() if view is not None else None)(mine()))
        self.refresh()
        self._ensure_following()

    # ---- rendering -----------------------------------------------------------------------------
    def _changed(self) -> None:
        self._dirty.set()
        self._ensure_following()

    def _ensure_following(self) -> None:
        with self._follow_lock:
            if not self._live or self._following or self._view_closed:
                return
            self._following = True
        threading.Thread(target=self._follow, name="ddp-session-view", daemon=True).start()

    def _follow(self) -> None:
        while not self._view_closed:
            try:
                state = self.refresh()
                ticking = state.status in ("forming", "ready", "running")  # else: nothing moves until a change
            except Exception:  # noqa: BLE001 - drawn again at the next tick; meanwhile the view goes stale, and says so
                ticking = True
            if ticking:
                self._dirty.wait(TICK_S)
            else:
                with self._follow_lock:
                    if not self._dirty.is_set():  # nothing to follow until the session changes
                        self._following = False
                        return
            self._dirty.clear()
            time.sleep(REFRESH_S)  # throttle: one redraw per period, however many changes came
        with self._follow_lock:
            self._following = False

    def close(self) -> None:
        """Close the view (its widgets leave the notebook) and stop following the session."""
        self._view_closed = True
        self._dirty.set()
        # Every widget of the view leaves the notebook's registry, which would otherwise keep its
        # buttons, their handlers, this view and its session alive.
        for part in _tree(self):
            if part is not self:
                part.close()
        super().close()


    def refresh(self, now: Optional[float] = None) -> SessionState:
        """Bring every widget in line with the session's state (thread-safe); the state drawn.
        ``now`` is the clock's time (default: the time now)."""
        with self._lock:
            state: SessionState = self.session.state
            now = now if now is not None else time.time()
            run = f" <code>{escape(state.run_id)}</code>" if state.run_id else ""
            cells = f" · {state.cells} cell{'s' if state.cells != 1 else ''} run" if state.cells else ""
            self.title.value = one_line(
                f"<b>Session</b>{run} {badge(state.status, STATUS_COLORS.get(state.status))} on "
                f"<code>{escape(', '.join(state.devices))}</code>{cells}")
            if state.status in ("forming", "ready", "running"):  # a new value every tick (liveness_html)
                self._tick += 1
                self.live.value = liveness_html(self.token, self._tick)
            else:
                self.live.value = ""
            if [r.rank for r in state.ranks] != list(self.rows):
                self.rows = {r.rank: _RankRow(r) for r in state.ranks}
                self.rows_box.children = [row.box for row in self.rows.values()]
                self.outputs.children = [widgets.HTML() for _ in self.rows]
                for i, r in enumerate(state.ranks):
                    self.outputs.set_title(i, f"rank {r.rank} {r.device}")
            for i, rank in enumerate(state.ranks):
                self.rows[rank.rank].render(rank, now)
                lines = [text for _stream, text in rank.output][-OUTPUT_LINES_SHOWN:]
                self.outputs.children[i].value = f"<pre>{escape(chr(10).join(lines))}</pre>"
            if self.message.value and state.last is not None and state.last.started_at > self._message_at:
                self.message.value = ""  # it spoke of what came before this request
            self.activity.value = activity_html(state, now)
            self.card.value = card_html(state)
            current = state.current
            stoppable = current is not None and current.background and state.status == "running"
            self.stop_button.layout.display = "" if stoppable else "none"
            self.stop_button.disabled = not stoppable or bool(current and current.interrupting)
            self.reform_box.layout.display = "" if state.can_reform else "none"
            self.reform_button.disabled = not state.can_reform
            self.reform_note.value = (f"forms the session again on <code>{escape(', '.join(state.devices))}</code>: "
                                      "new ranks and a new process group; <b>the ranks' namespaces are lost</b> "
                                      "(what cells defined and what was pushed)")
        self._status_changed(state)
        return state

    def fallback_html(self) -> str:
        """The session as static HTML (redrawn at each status change, not as time passes): its
        text, and the failure card when there is one."""
        state = self.session.state
        text = format_session(state, frozen=True)  # not redrawn as time passes: since when, not how long
        return f'<div class="ddp-fallback"><pre>{escape(text)}</pre>{card_html(state)}</div>'

    def __repr__(self) -> str:
        return format_session(self.session.state)

    # ---- a display kept current (ui.display.display_kept_current) ----------------------------------
    def keep_current(self, update: Callable[[Any], None]) -> None:
        """Call ``update(self)`` now and at each status change of the session (a request starts or
        ends, a rank changes state), never at each tick: a display's fallback says what is true."""
        self._update = update
        self._shown_key = None
        self._status_changed(self.session.state)

    @staticmethod
    def status_key(state: SessionState) -> tuple:
        last = state.last
        return (state.status, state.run_id, tuple(r.status for r in state.ranks),
                state.current.what if state.current else None, (last.what, last.outcome) if last else None)

    def _status_changed(self, state: SessionState) -> None:
        if self._update is None:
            return
        with self._update_lock:
            key = self.status_key(state)
            if key == self._shown_key:
                return
            self._shown_key = key
            self._update(self)

    # ---- actions -------------------------------------------------------------------------------
    def _say(self, html: str) -> None:
        self.message.value = html
        self._message_at = time.time()

    def stop(self) -> None:
        """Interrupt the cell running without blocking on every rank (``session.interrupt()``)."""
        if not self.session.interrupt():
            self._say("<i>Nothing to stop: no cell is running.</i>")
        self.refresh()

    def reform(self) -> None:
        """Form the session again on its devices (``session.restart()``): one per click sequence."""
        said = io.StringIO()

        def begin() -> Any:
            self.message.value = ""
            with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
                self.session.restart()
            if self.on_reform is not None:
                self.on_reform(self.session)
            return self.session.current_run

        try:
            run, refused = self.reforms.start(begin)
        except DDPNotebookError as e:
            self._say(f'<span style="color:{RED}">Re-form failed: {escape(str(e))}</span>')
            self.refresh()
            return
        if refused:
            self._say(f'<span style="color:{RED}">{escape(refused)}</span>')
        if run is not None:
            text = said.getvalue().strip() or "Session formed again: the ranks' namespaces were lost"
            self._say(f'<span class="ddp-reformed" style="color:{GREEN}">{escape(text)}.</span>')
        self.refresh()


def activity_html(state: SessionState, now: float) -> str:
    """What runs now (its clock ticking), else how the last request ended, and why the session
    ended when it did; while a cell runs, what stops it."""
    parts = []
    current = state.current
    if current is not None and state.status == "running":
        code = f": <code>{escape(tail_of(current.first_line, 100))}</code>" if current.first_line else ""
        stopping = (f' · <b style="color:{ORANGE}">interrupting on every rank…</b>' if current.interrupting else "")
        how = "" if current.cell is None else " · <i>Stop interrupts it on every rank</i>" if current.background \
            else " · <i>Kernel → Interrupt stops it on every rank</i>"
        parts.append(f"<b>Running</b> {escape(current.what)} on {escape(ranks_text(current.ranks))} for "
                     f"{seconds_text(now - current.started_at)}{stopping}{code}{how}")
    elif state.last is not None:
        last = state.last
        color = OUTCOME_COLORS.get(last.outcome, GREY)
        parts.append(f'<span style="color:{color}"><b>Last:</b> {escape(last.text())}</span>')
    if state.ended and state.failure is not None:  # the card below says what ended it
        parts.append(f'<span style="color:{RED}"><b>Ended:</b> the failure below ended the session: its ranks are '
                     "gone.</span>")
    elif state.ended:
        parts.append(f'<span style="color:{RED}"><b>Ended:</b> {escape(state.ended)}</span>')
    elif state.status == "closed":
        parts.append("<i>Closed: its ranks have left; ddp_notebook.session(...) or %ddp_session forms a new one.</i>")
    return "".join(f'<div style="{WRAP}">{p}</div>' for p in parts)


def card_html(state: SessionState) -> str:
    """The failure card: of the rank failure that ended the session; else of the last cell when it
    failed on some ranks (with the failed rank's locals), open while nothing runs after it; else of
    the last cell that failed, folded under a line that names it; "" when no cell failed."""
    if state.status == "ended" and state.failure is not None:
        return failure_card_html(state.failure, state.failures, state.healthy)
    failed = state.last_failure
    if failed is None or failed.failure is None:
        return ""
    if failed is state.last and state.status in ("ready", "closed"):
        return cell_card_html(failed, state)
    return (f'<details class="ddp-last-failure"><summary style="color:{RED}">Last failure: '
            f"{escape(failed.text())}</summary>{cell_card_html(failed, state)}</details>")


def cell_card_html(failed: Outcome, state: SessionState) -> str:
    """A failed cell's card: a run's failure card, with a session's hint."""
    root = failed.failures[0]
    raised = sorted({f.rank for f in failed.failures})
    healthy = [r.device for r in state.ranks if r.rank not in raised]
    card = failure_card_html(root, failed.failures, healthy)
    # A run's hint speaks of retries; a cell is fixed and run again, in the same session.
    run_hint = f"<b>Hint:</b> {escape(hint_for(root, healthy))}</div>"
    return card.replace(run_hint, f"<b>Hint:</b> {escape(cell_hint(root, raised))}</div>", 1)


def cell_hint(root: WorkerFailure, raised: list[int]) -> str:
    """What to do after a cell failed on some ranks: the session goes on, so fix the cell and run
    it again; where only some ranks raised, what they held tells why.

    >>> f = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="ValueError")
    >>> cell_hint(f, [1])[:72]
    'Only rank 1 raised it: compare what it held (its locals below) with the '
    """
    again = "fix the cell and run it again: the session goes on, its namespaces kept."
    if root.same_on:
        return f"Every rank raised this same error: it comes from the cell's code or data; {again}"
    return (f"Only {ranks_text(raised)} raised it: compare what it held (its locals below) with the other ranks' "
            f"(a shape, dtype or device that differs by rank is the usual cause); {again}")


def show_session(session: Any, on_reform: Optional[Callable[[Any], None]] = None) -> SessionView:
    """Display the live view of ``session`` in the notebook, its fallback kept current.

    Parameters
    ----------
    session : Session
        The session to show.
    on_reform : callable, optional
        Called with the session after a Re-form clicked in the view.

    Returns
    -------
    SessionView
        The view displayed.
    """
    from .display import display_kept_current

    view = SessionView(session, on_reform=on_reform)
    display_kept_current(view)
    return view


def _tree(widget: widgets.Widget) -> list[widgets.Widget]:
    """``widget`` and every widget under it (a box's children, an accordion's), innermost last."""
    out, todo = [], [widget]
    while todo:
        w = todo.pop()
        out.append(w)
        todo.extend(c for c in getattr(w, "children", ()) if isinstance(c, widgets.Widget))
    return out
