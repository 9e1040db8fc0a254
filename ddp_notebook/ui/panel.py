"""The panel (ipywidgets 8): controls to pick, validate and launch a device list, above the live
views of a run and its retries. What to offer, how to validate and how to launch are given to
it; it renders and calls, nothing more.
"""
from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from html import escape
from typing import Any, Optional, Union

import ipywidgets as widgets

from ..core.errors import DDPNotebookError
from ..core.events import EventKind
from ..core.validation import ValidationReport
from ..lifecycle.restarts import show_follow_ons_with
from .html import RED, report_html
from .run_view import FullText, RunForms, RunView, StartGuard

__all__ = ["DDPPanel", "StaticRuns", "KeptCurrent", "follow_ons_only_in"]

log = logging.getLogger(__name__)


#: Seconds a front end has to open a view of a display before its HTML form is kept current.
VIEW_WAIT = 5.0
#: Seconds between two sends of the HTML form of a display that no front end shows as a widget.
HTML_PACE = 1.0


class KeptCurrent:
    """What a display kept current (``ui.display``) needs of what it shows: its ``views`` (each
    with its ``run``, ``status_key``, ``fallback_html`` and text), the display's update called
    at each status change of their runs (``keep_current``), whether one goes on, and its forms."""

    views: list[Any]
    _view_count: Any  # ipywidgets' count of the front end views of a widget (0: none opened)
    follows_on = True  # a run that follows one it shows shows below (``follow_ons_only_in``)

    def _kept_init(self) -> None:
        self._update: Optional[Callable[[Any], None]] = None
        self._shown_key: Any = None
        self._update_lock = threading.Lock()
        self.changed = threading.Event()  # set by the runs' threads; the display's thread sends
        self._paced_from: Optional[float] = None  # when the HTML form starts to be sent at a pace
        self._follower: Optional[threading.Thread] = None  # the display's thread, while a run goes on
        self._follower_lock = threading.Lock()

    def keep_current(self, update: Callable[[Any], None], wait: Optional[float] = None) -> None:
        """Have ``update(self)`` called at each status change of the runs shown (never at each
        report): a display's fallback then says what is true, and ends on the outcome. If no front
        end opens a view of it within ``wait`` seconds (None: never asked), it is called every
        ``HTML_PACE`` too while a run goes on (its HTML form shows: the steps, rates and clock move).

        While a run goes on, the display's own thread calls it: a change only sets ``changed``,
        and a run's supervising thread never waits on a drawing. The end is sent at once, on the
        thread that saw it, before the run's ``wait()`` returns: what a notebook executed without a
        front end keeps."""
        self._update = update
        self._shown_key = None
        self._paced_from = None if wait is None else time.monotonic() + wait
        self._status_changed()

    def _status_changed(self) -> None:
        if self._update is None:
            return
        if not self.going_on():
            self.send_current()
            return
        if self._status() != self._shown_key:  # (read without the lock; a send rechecks after it)
            self.changed.set()
        with self._follower_lock:  # (the thread ends under it: a run shown as it ends is seen)
            if self._follower is None:  # the first run, or one shown after the others ended
                self._follower = threading.Thread(target=_follow, args=(weakref.ref(self), self.changed),
                                                  name="ddp-display", daemon=True)
                self._follower.start()

    def send_current(self, force: bool = False, going_on: bool = False) -> None:
        """Call the display's update if the status shown changed since the last one (every time
        with ``force``): one at a time, whichever thread asks. ``going_on``: only while a run goes
        on (the display's thread leaves the end to the thread that saw it, whose cell keeps it)."""
        update = self._update
        if update is None:
            return
        with self._update_lock:
            key = self._status()
            if going_on and not self.going_on():  # (after the key: a key read before the end is
                return  # sent here, one read after it is left to the thread that saw the end)
            if key == self._shown_key and not force:
                return
            self._shown_key = key
            update(self)
            if self._status() != key:  # changed while it was sent: sent again
                self.changed.set()

    def _status(self) -> tuple:
        return tuple(v.status_key() for v in self.views)

    def going_on(self) -> bool:
        """Whether a run it shows goes on (its display may still change)."""
        return any(not v.run.state.finished for v in self.views)

    def fallback_html(self) -> str:
        return "".join(v.fallback_html() for v in self.views) or "<pre>DDPPanel (no run yet)</pre>"

    def __repr__(self) -> str:
        return "\n".join(repr(v) for v in self.views) or "DDPPanel (no run yet)"


def _follow(kept: Callable[[], Optional[KeptCurrent]], changed: threading.Event) -> None:
    """The display's thread: sends at each status change while a run goes on, and at the pace
    once no widget view opened in time; ends with the runs (their end is sent by the thread that
    saw it), when the display is closed, or when a send fails (logged; the next status change
    starts another)."""
    me = threading.current_thread()
    try:
        while True:
            shown = kept()
            if shown is None or shown._update is None:
                return
            if shown._view_count:  # a widget view: it follows the runs itself
                shown._paced_from = None
            paced_from = shown._paced_from
            paced = paced_from is not None and time.monotonic() >= paced_from
            changed.clear()
            with shown._follower_lock:
                if not shown.going_on():
                    shown._follower = None  # a run shown after this starts another
                    return
            shown.send_current(force=paced, going_on=True)
            del shown  # (not held while asleep)
            changed.wait(HTML_PACE if paced else 0.2 if paced_from is not None else 1.0)
    except Exception:  # a front end's failure must not go unsaid; the runs go on regardless
        log.exception("a display of runs could not be sent")
    finally:
        shown = kept()
        if shown is not None:
            with shown._follower_lock:
                if shown._follower is me:
                    shown._follower = None


class StaticRuns(KeptCurrent):
    """Runs shown in their static forms alone, no widget made (``ui="html"``: HTML and text;
    ``"text"``: text): what ``ui.display`` keeps current in place where widgets are not wanted. A
    run that follows one it shows (a restart, a session formed again) shows below it."""

    _view_count = 0  # no front end opens a view of it

    def __init__(self, run: Any, html: bool) -> None:
        self.html = html
        self.views: list[RunForms] = []
        self._kept_init()
        _panels.add(self)
        self.show(run)

    def show(self, run: Any) -> None:
        """Show ``run`` below the others (once)."""
        if any(v.run is run for v in self.views):
            return
        self.views.append(RunForms(run))
        run.subscribe(lambda _event: self._status_changed())
        self._status_changed()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict[str, str]:
        data = {"text/plain": repr(self)}
        if self.html:
            data["text/html"] = self.fallback_html()
        return data


class DDPPanel(KeptCurrent, FullText, widgets.VBox):
    """Controls (device picker, Validate, Launch) above the views of a run and its retries.

    ``launcher(devices) -> Run`` starts a run on the chosen devices (``%ddp_fit`` gives one);
    ``available`` are the devices the picker offers (or a function that finds them: called on a
    thread of its own, the picker offering the ``selected`` ones meanwhile, since finding the GPUs
    imports torch, seconds in a notebook that has not) and ``validator(devices) -> report`` checks
    a choice (a run's ``_device_choices()`` and ``_validate_devices``). Without a launcher the panel
    only shows ``run`` and its retries. ``on_start(run)`` hears of every run the panel starts
    (launches and retries), so the notebook's idea of the current run follows it.

    One run at a time: Launch, and the retry buttons of every view, start one run per click
    sequence (a double click starts one, from any thread) and refuse while the panel's latest run
    goes on; Launch is disabled meanwhile, and enabled again when it ends.

    ``keep_current(update)`` has ``update(panel)`` called at each status change of what it shows
    (``ui.display`` passes the display's update, so its fallback ends on the outcome).
    """

    def __init__(self, run: Any = None, launcher: Optional[Callable[[list[str]], Any]] = None,
                 available: Union[Sequence[str], Callable[[], Sequence[str]]] = (),
                 selected: Optional[Sequence[str]] = None,
                 validator: Optional[Callable[[list[str]], ValidationReport]] = None,
                 on_start: Optional[Callable[[Any], None]] = None) -> None:
        super().__init__()
        _panels.add(self)
        if launcher is not None and validator is None:
            raise TypeError("a panel that launches needs a validator (for instance run._validate_devices)")
        self.launcher = launcher
        self.validator = validator
        self.on_start = on_start
        self.views: list[RunView] = []
        self.launches = StartGuard("launching another")
        self._kept_init()
        self._refusal = ""  # the last "stop it before launching another" shown
        self.views_box = widgets.VBox()
        self.report = widgets.HTML()
        children: list[Any] = []
        if launcher is not None:
            find = available if callable(available) else None
            options = list(selected or ()) if find is not None else list(available)  # type: ignore[arg-type]
            chosen = [d for d in (selected or options[:2]) if d in options] or options[:1]
            self.picker = widgets.SelectMultiple(options=options, value=tuple(chosen),
                                                 rows=min(6, max(len(options), 1)), description="devices")
            if find is not None:
                threading.Thread(target=self._offer, args=(find,), name="ddp-device-choices", daemon=True).start()
            self.validate_button = widgets.Button(description="Validate", icon="check")
            self.launch_button = widgets.Button(description="Launch", icon="play", button_style="success")
            self.validate_button.on_click(lambda _: self.validate())
            self.launch_button.on_click(lambda _: self.launch())
            children.append(widgets.HBox([self.picker, widgets.VBox([self.validate_button, self.launch_button])]))
            children.append(self.report)
        children.append(self.views_box)
        self.children = children
        if run is not None:
            self.show(run)

    def _offer(self, find: Callable[[], Sequence[str]]) -> None:
        """Offer the devices ``find`` finds, the choice kept (the run's devices come first until then)."""
        try:
            found = list(find())
        except Exception as e:  # noqa: BLE001 - said where the choice is made; the run's devices stay offered
            self.report.value = f'<span style="color:{RED}">Finding the devices failed: {escape(str(e))}</span>'
            return
        chosen = self.picker.value
        self.picker.options = found + [d for d in self.picker.options if d not in found]
        self.picker.value = tuple(d for d in chosen if d in self.picker.options)
        self.picker.rows = min(6, max(len(self.picker.options), 1))

    def chosen_devices(self) -> list[str]:
        # ranks follow the order of the picker's options, so cpu:0 stays the main worker
        return [d for d in self.picker.options if d in self.picker.value]

    def validate(self) -> bool:
        assert self.validator is not None
        report = self.validator(self.chosen_devices())
        self.report.value = report_html(report)
        return report.ok

    def launch(self) -> Optional[Any]:
        """Validate the chosen devices and launch a run on them (nothing while the panel's latest
        run goes on, or for the second click of a double click)."""
        if self.launcher is None:
            return None
        run, refused = self.launches.start(self._launch_once)
        if refused:
            self._refuse(refused)
        return run

    def _busy_with(self) -> Optional[Any]:
        """The panel's latest run while it goes on."""
        current = self.views[-1].run if self.views else None
        return current if current is not None and not current.state.finished else None

    def _refuse(self, text: str) -> None:
        self._refusal = f'<span style="color:{RED}">{escape(text)}</span>'
        self.report.value = self._refusal

    def _launch_once(self) -> Optional[Any]:
        assert self.launcher is not None
        current = self._busy_with()
        if current is not None:
            self._refuse(f"Run {current.id} is still {current.status}: stop it before launching another.")
            return None
        if not self.validate():
            return None
        try:
            run = self.launcher(self.chosen_devices())
        except DDPNotebookError as e:
            self.report.value = f'<span style="color:{RED}">{escape(str(e))}</span>'
            return None
        self.show(run)
        if self.on_start is not None:
            self.on_start(run)
        return run

    def _follow_launch_button(self, run: Any) -> None:
        """Launch off while ``run`` (the panel's latest) goes on, on again once it ends."""
        if self.launcher is None:
            return

        def on_event(event: dict[str, Any]) -> None:
            if event.get("kind") == EventKind.RUN_FINISHED and self.views and self.views[-1].run is run:
                self.launch_button.disabled = False
                if self.report.value == self._refusal:  # no longer true: the run has ended
                    self.report.value = ""

        run.subscribe(on_event)  # first: an end that comes meanwhile is seen by one of the two
        self.launch_button.disabled = not run.state.finished

    def show(self, run: Any, title: Optional[str] = None) -> RunView:
        """Add a view of ``run`` (a retry's view goes below the run it retries); its view when the
        panel shows it already (a session formed again is told here twice: by the retry's button
        and by the session)."""
        shown = next((v for v in self.views if v.run is run), None)
        if shown is not None:
            return shown
        def on_retry(devices: list[str], parent: Any = run) -> Any:
            current = self._busy_with()
            if current is not None:
                raise DDPNotebookError(f"Run {current.id} is still {current.status}: stop it before retrying.")
            new = parent.retry(device=devices[0]) if len(devices) == 1 else parent.retry(devices=devices)
            self.show(new)  # its view says it is a retry, of which run, on which devices
            if self.on_start is not None:
                self.on_start(new)
            return new

        view = RunView(run, title=title, on_retry=on_retry if hasattr(run, "retry") else None)
        self.views.append(view)
        self.views_box.children = list(self.views)
        for older in self.views[:-1]:  # what they say of the run after theirs (a session formed again)
            older.refresh()
        self._follow_launch_button(run)
        run.subscribe(lambda _event: self._status_changed())
        self._status_changed()
        return view

    def close(self) -> None:
        """Close the panel and its views (they stop following their runs, and its display is no
        longer sent)."""
        self._update = None
        for view in self.views:
            view.close()
        super().close()


_panels: weakref.WeakSet[Any] = weakref.WeakSet()  # panels and static views: a run that follows one shows below it


def _show_follow_on(before: Any, new: Any) -> None:
    """A run a panel shows is followed by another (a restart, a session formed again): the new
    run shows below it (in each panel that follows on, ``follow_ons_only_in``)."""
    for panel in list(_panels):
        if panel.follows_on and any(v.run is before for v in panel.views):
            panel.show(new)


def follow_ons_only_in(panel: Any, run: Any) -> None:
    """``panel`` shows ``run`` anew (a session shown again, ``%ddp_session``): the runs that follow
    it show below in ``panel``, no longer in the panels shown before it, which end with the runs
    they show (each would follow every later run live: a session formed again many times kept a
    view, and its threads, per time it was shown)."""
    for other in list(_panels):
        if other is not panel and any(v.run is run for v in other.views):
            other.follows_on = False


show_follow_ons_with(_show_follow_on)
