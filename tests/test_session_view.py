"""The session's view, fed with state by hand (no process): rows that say each rank's state and
the cell it runs with a ticking clock, the last outcome, the failure card with the failed rank's
locals, Stop while a cell runs (acted on as the click arrives), Re-form once the session has
ended (one per double click, saying the namespaces are lost), and the same in words for what
shows no widget. One test at the end runs a real session in a real kernel."""
from __future__ import annotations

import gc
import re
import sys
import threading
import time
import weakref

import ipywidgets as widgets
import pytest

from ddp_notebook.core.failures import WorkerFailure
from ddp_notebook.lifecycle.session_state import (
    Outcome,
    RankState,
    Request,
    SessionState,
    format_session,
    seconds_text,
)
from ddp_notebook.ui.session_view import SessionView, card_html

from helpers import wait_until

T0 = 1_800_000_000.0
DEVICES = ("cpu:0", "cpu:1")


def ranks(*statuses, **extra):
    return tuple(RankState(r, DEVICES[r], s, pid=100 + r, **extra) for r, s in enumerate(statuses))


def ready(**changes):
    base = dict(status="ready", devices=DEVICES, ranks=ranks("idle", "idle"), run_id="20260101-000000-abcdef",
                formed_at=T0 - 30)
    return SessionState(**{**base, **changes})


def running(cell=3, interrupting=False):
    request = Request(f"cell {cell}", (0, 1), T0, cell, "for i in range(10**9): pass", interrupting)
    return ready(status="running", current=request,
                 ranks=tuple(RankState(r, DEVICES[r], "running", pid=100 + r, doing=f"cell {cell}", since=T0)
                             for r in (0, 1)))


def cell_failure():
    return WorkerFailure(rank=1, device="cpu:1", kind="exception", time=T0, pid=101, exc_type="ValueError",
                         message="bad shape (3, 3)", traceback="Traceback (most recent call last):\n  ...\n"
                         "ValueError: bad shape (3, 3)",
                         locals={"t": "Tensor[3, 3] float32 cpu", "rank": "1"},
                         locals_frames=[{"function": "<module>", "file": "<ddp cell 4>", "line": 3,
                                         "locals": {"t": "Tensor[3, 3] float32 cpu", "rank": "1"}}])


def failed_cell():
    f = cell_failure()
    last = Outcome("cell 4", (0, 1), "failed", T0, T0 + 0.2, 4,
                   "cell 4 failed on rank 1 (cpu:1): ValueError: bad shape (3, 3). The session goes on: its "
                   "namespaces are kept.", (f,))
    return ready(cells=4, last=last, last_failure=last, ranks=(
        RankState(0, "cpu:0", "idle", pid=100, doing="cell 4", since=T0, until=T0 + 0.1),
        RankState(1, "cpu:1", "failed", pid=101, doing="cell 4", since=T0, until=T0 + 0.2, note=f.summary())))


def ended():
    death = WorkerFailure(rank=1, device="cpu:1", kind="signal", time=T0, pid=101, signal="SIGKILL")
    why = ("the session ended: Distributed data parallel worker 1 (cpu:1) failed: killed by signal SIGKILL. "
           "session.restart() forms it again on cpu:0, cpu:1 (the ranks' namespaces are lost)")
    return ready(status="ended", ended=why, failure=death, failures=(death,), healthy=("cpu:0",),
                 ranks=(RankState(0, "cpu:0", "ended", pid=100),
                        RankState(1, "cpu:1", "failed", pid=101, note=death.summary())))


class FakeRun:
    def __init__(self, finished):
        self.state = type("S", (), {"finished": finished, "run_id": "r2", "status": "running"})()


class FakeSession:
    """What the view reads of a session: ``state``, ``subscribe``, ``interrupt``, ``restart``."""

    def __init__(self, state):
        self.state = state
        self.listeners = []
        self.interrupts = 0
        self.restarts = 0
        self.current_run = FakeRun(finished=True)

    def subscribe(self, callback):
        self.listeners.append(callback)

    def interrupt(self):
        self.interrupts += 1
        return self.state.current is not None and self.state.current.cell is not None

    def restart(self):
        self.restarts += 1
        print("Session formed again on cpu:0, cpu:1 (run r2, after r1): the ranks' namespaces were lost",
              file=sys.stderr)
        self.state = ready(run_id="r2")
        self.current_run = FakeRun(finished=False)
        return self


def text_of(html):
    return re.sub(r"<[^>]+>", "", html).replace("&#x27;", "'")


@pytest.mark.unit
def test_a_row_per_rank_says_its_state_and_the_cell_it_runs_on_a_clock_that_ticks():
    session = FakeSession(running())
    view = SessionView(session, live=False)
    view.refresh(now=T0 + 2.0)
    # No Stop button (a click waits for the cell to end): the view says what stops a cell.
    assert not any(isinstance(w, widgets.Button) and w.description == "Stop" for w in view.children[0].children)
    assert "Kernel → Interrupt stops it on every rank" in text_of(view.activity.value)
    assert [text_of(row.badge.value) for row in view.rows.values()] == ["running", "running"]
    assert "cell 3 · 2.0 s" in text_of(view.rows[1].doing.value)
    assert "pid 101" in text_of(view.rows[1].doing.value)
    assert "Running cell 3 on ranks 0, 1 for 2.0 s" in text_of(view.activity.value)
    view.refresh(now=T0 + 3.5)  # the clock moves without any change of state
    assert "cell 3 · 3.5 s" in text_of(view.rows[1].doing.value)
    assert "for 3.5 s" in text_of(view.activity.value)
    session.state = ready()
    view.refresh(now=T0 + 4)
    assert [text_of(row.badge.value) for row in view.rows.values()] == ["idle", "idle"]
    assert "ready" in text_of(view.title.value) and "cpu:0, cpu:1" in text_of(view.title.value)


@pytest.mark.unit
def test_the_last_outcome_and_a_rank_that_finished_while_the_other_runs():
    state = running()
    state = ready(status="running", current=state.current, ranks=(
        RankState(0, "cpu:0", "finished", pid=100, doing="cell 3", since=T0, until=T0 + 0.5),
        RankState(1, "cpu:1", "running", pid=101, doing="cell 3", since=T0)))
    view = SessionView(FakeSession(state), live=False)
    view.refresh(now=T0 + 5)
    assert text_of(view.rows[0].badge.value) == "finished"
    assert "cell 3 done in 0.5 s · waits" in text_of(view.rows[0].doing.value)
    ok = Outcome("cell 5", (0, 1), "ok", T0, T0 + 0.04, 5, values=("[rank 0] 1", "[rank 1] 11"))
    view.session.state = ready(last=ok, cells=5)
    view.refresh(now=T0 + 6)
    assert "Last: cell 5 on ranks 0, 1: ok in 0.0 s ([rank 0] 1, [rank 1] 11)" in text_of(view.activity.value)
    assert "5 cells run" in text_of(view.title.value)


@pytest.mark.unit
def test_a_failed_cell_shows_the_runs_failure_card_with_the_failed_ranks_locals():
    view = SessionView(FakeSession(failed_cell()), live=False)
    card = view.card.value
    assert 'class="ddp-failure"' in card
    assert "Distributed data parallel worker 1 (cpu:1) failed: ValueError: bad shape (3, 3)" in text_of(card)
    assert "Locals in &lt;module&gt;" in card or "Locals in <module>" in text_of(card)
    assert "Tensor[3, 3] float32 cpu" in card and 'class="ddp-locals"' in card
    assert text_of(view.rows[1].badge.value) == "failed" and "2px solid" in view.rows[1].box.layout.border
    assert "ValueError: bad shape (3, 3)" in text_of(view.rows[1].note.value)
    assert text_of(view.rows[0].badge.value) == "idle"
    assert "The session goes on" in text_of(view.activity.value)
    assert view.reform_box.layout.display == "none"  # the session goes on: nothing to re-form
    assert card == card_html(failed_cell())
    # The hint is a session's (fix the cell, run it again), not a run's (retry on other devices).
    assert "Only rank 1 raised it: compare what it held (its locals below)" in text_of(card)
    assert "run it again: the session goes on" in text_of(card) and "retry" not in card.lower()
    # The next cell runs: the card is folded under a line that names the cell it was (kept: the
    # cells after a failure are often the ones that look into it).
    failure = failed_cell().last
    view.session.state = ready(status="running", current=running(cell=5).current, last_failure=failure, last=failure)
    view.refresh(now=T0 + 1)
    assert view.card.value.startswith('<details class="ddp-last-failure">')
    assert "Last failure: cell 4 failed on rank 1 (cpu:1): ValueError: bad shape (3, 3)" in text_of(view.card.value)
    ok = Outcome("cell 5", (0, 1), "ok", T0 + 1, T0 + 2, 5)
    view.session.state = ready(last=ok, last_failure=failure)
    view.refresh(now=T0 + 3)
    assert view.card.value.startswith('<details class="ddp-last-failure">') and "Tensor[3, 3]" in view.card.value
    assert "Last failure: cell 4 failed on rank 1" in format_session(view.session.state)


@pytest.mark.unit
def test_a_cell_being_interrupted_says_so():
    session = FakeSession(running(interrupting=True))
    view = SessionView(session, live=False)
    view.refresh(now=T0 + 1)
    assert "interrupting on every rank" in text_of(view.activity.value)


@pytest.mark.unit
def test_an_ended_session_offers_re_form_which_says_namespaces_are_lost_and_runs_once_per_double_click():
    session = FakeSession(ended())
    view = SessionView(session, live=False)
    assert view.reform_box.layout.display == "" and not view.reform_button.disabled
    assert "the ranks' namespaces are lost" in text_of(view.reform_note.value)
    assert "killed by signal SIGKILL" in text_of(view.card.value)
    assert [text_of(r.badge.value) for r in view.rows.values()] == ["ended", "failed"]
    assert "Ended: the failure below ended the session: its ranks are gone" in text_of(view.activity.value)
    view.reform_button.click()
    view.reform_button.click()  # the second click of a double click
    assert session.restarts == 1
    assert "Session formed again on cpu:0, cpu:1" in text_of(view.message.value)
    assert "namespaces were lost" in text_of(view.message.value)
    assert view.reform_box.layout.display == "none"  # formed again: nothing to re-form
    assert "ready" in text_of(view.title.value) and "r2" in text_of(view.title.value)
    view.refresh()
    assert "formed again" in text_of(view.message.value)
    later = time.time() + 1  # a cell run after it: the message spoke of what came before
    session.state = ready(run_id="r2", last=Outcome("cell 1", (0, 1), "ok", later, later + 0.1, 1))
    view.refresh()
    assert view.message.value == ""


@pytest.mark.unit
def test_re_form_that_fails_says_why():
    from ddp_notebook.errors import SessionEndedError

    session = FakeSession(ended())

    def refuse():
        raise SessionEndedError("the session could not start: no such device")

    session.restart = refuse
    view = SessionView(session, live=False)
    view.reform_button.click()
    assert "Re-form failed: the session could not start" in text_of(view.message.value)


@pytest.mark.unit
def test_the_fallback_says_the_same_in_words_and_is_kept_current_at_status_changes_only():
    session = FakeSession(failed_cell())
    view = SessionView(session, live=False)
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == repr(view) == format_session(session.state)
    assert "rank 1 (cpu:1, pid 101): failed in cell 4: ValueError: bad shape (3, 3)" in bundle["text/plain"]
    assert "Last: cell 4 failed on rank 1 (cpu:1)" in bundle["text/plain"]
    assert 'class="ddp-failure"' in bundle["text/html"] and "Tensor[3, 3] float32 cpu" in bundle["text/html"]
    updates = []
    view.keep_current(updates.append)
    view.refresh(now=T0 + 1)
    view.refresh(now=T0 + 2)  # a tick: no update
    assert len(updates) == 1
    session.state = running()
    view.refresh(now=T0 + 3)
    session.state = ready(last=Outcome("cell 5", (0, 1), "ok", T0, T0 + 1, 5))
    view.refresh(now=T0 + 4)
    assert len(updates) == 3


@pytest.mark.unit
def test_format_session_in_words():
    text = format_session(running(), now=T0 + 1.25)
    assert text.splitlines() == [
        "Session of 2 ranks on cpu:0, cpu:1 (run 20260101-000000-abcdef): running",
        "  rank 0 (cpu:0, pid 100): running cell 3 for 1.2 s",
        "  rank 1 (cpu:1, pid 101): running cell 3 for 1.2 s",
        "Running cell 3 on ranks 0, 1 for 1.2 s: for i in range(10**9): pass",
    ]
    text = format_session(ended(), now=T0)
    assert "rank 0 (cpu:0, pid 100): ended" in text and "rank 1 (cpu:1, pid 101): failed: killed by signal SIGKILL" in text
    assert text.splitlines()[-1].startswith("Ended: the session ended: Distributed data parallel worker 1")
    closed = format_session(ready(status="closed", ranks=ranks("closed", "closed")))
    assert closed.splitlines()[0].endswith(": closed")
    assert [seconds_text(s) for s in (0.04, 2.0, 75, 3720)] == ["0.0 s", "2.0 s", "1 min 15 s", "1 h 2 min"]


@pytest.mark.unit
def test_markup_in_a_cell_or_its_output_shows_as_text():
    hostile = '<img src=x onerror="alert(1)">'
    state = running()
    state = ready(status="running", current=Request("cell 3", (0, 1), T0, 3, hostile),
                  ranks=tuple(RankState(r, DEVICES[r], "running", doing="cell 3", since=T0,
                                        output=(("stdout", hostile),)) for r in (0, 1)))
    view = SessionView(FakeSession(state), live=False)
    html = view.activity.value + view.rows[0].last.value + view.outputs.children[0].value
    assert "<img" not in html and "&lt;img" in html


@pytest.mark.unit
def test_outside_a_notebook_a_session_shows_its_text():
    from ddp_notebook.ui.session_magics import show_session_view

    assert show_session_view(object()) is False  # no kernel here: the text


@pytest.mark.kernel
@pytest.mark.processes
def test_a_real_session_in_a_kernel_shows_its_view_and_its_state_follows_the_cells():
    from jupyter_client.manager import start_new_kernel
    from session_kernel import Kernel, _all_ended

    from helpers import wait_until

    started = time.monotonic()
    km, kc = start_new_kernel(kernel_name="python3")
    k, pids = Kernel(km, kc), []
    try:
        views = []

        def hook(msg):
            if msg["msg_type"] in ("display_data", "update_display_data"):
                views.append(msg["content"]["data"])

        reply = kc.execute_interactive("%load_ext ddp_notebook\n%ddp_session cpu*2", timeout=120, output_hook=hook)
        assert reply["content"]["status"] == "ok"
        assert any("application/vnd.jupyter.widget-view+json" in v for v in views), views
        assert "Session of 2 ranks on cpu:0, cpu:1" in views[-1]["text/plain"]
        pids = k.rank_pids()
        k.execute("%%ddp\nx = torch.zeros(rank + 2)\nif rank == 1:\n    raise ValueError(f'bad {tuple(x.shape)}')")
        printed = k.ok("from ddp_notebook.ui.session_view import SessionView\n"
                       "v = SessionView(_ddp_session, live=False)\n"
                       "print(repr(v)); print('CARD', 'Tensor[3] float32 cpu' in v.card.value)")
        assert "rank 1 (cpu:1, pid " in printed and "failed in cell 1: ValueError: bad (3,)" in printed, printed
        assert "CARD True" in printed, printed
        printed = k.ok("%%ddp\nx.sum().item()\n")
        printed = k.ok("print(repr(v))")
        assert "Last: cell 2 on ranks 0, 1: ok in" in printed and "[rank 0] 0.0, [rank 1] 0.0" in printed, printed
        printed = k.ok("%ddp_session --stop\nprint(repr(v))")
        assert "): closed" in printed, printed
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    wait_until(lambda: _all_ended(pids), timeout=30)
    assert time.monotonic() - started < 60


def test_the_fallback_says_since_when_a_cell_runs_not_a_clock_that_would_stop():
    from ddp_notebook.lifecycle.session_state import Request, format_session

    state = ready(status="running", current=Request("cell 5", (0, 1), T0, 5, "import time"), ranks=(
        RankState(0, "cpu:0", "running", pid=100, doing="cell 5", since=T0),
        RankState(1, "cpu:1", "running", pid=101, doing="cell 5", since=T0)))
    view = SessionView(FakeSession(state), live=False)
    fallback = text_of(view.fallback_html())
    at = time.strftime("%H:%M:%S", time.localtime(T0))
    assert f"Running cell 5 on ranks 0, 1 since {at}" in fallback and f"running cell 5 since {at}" in fallback
    assert " for " not in fallback.split("\n", 1)[1], fallback
    assert "Running cell 5 on ranks 0, 1 for 2.0 s" in format_session(state, now=T0 + 2)  # print(session): now


def _view_threads():
    return sum(1 for t in threading.enumerate() if t.name == "ddp-session-view")


@pytest.mark.unit
def test_a_views_thread_runs_only_while_the_session_can_change_and_never_outlives_the_view():
    before = _view_threads()
    session = FakeSession(ready())
    views = [SessionView(session) for _ in range(3)]
    wait_until(lambda: _view_threads() == before + 3, timeout=30)  # a ready session's clock ticks
    session.state = ready(status="closed", ranks=ranks("closed", "closed"))
    for tell in session.listeners:
        tell()
    wait_until(lambda: _view_threads() == before, timeout=30)  # closed: nothing moves, no thread waits
    assert all("closed" in text_of(v.title.value) for v in views)
    session.state = ready(run_id="r2")  # formed again (session.restart()): followed again
    for tell in session.listeners:
        tell()
    wait_until(lambda: _view_threads() == before + 3, timeout=30)
    for view in views:
        view.close()
    wait_until(lambda: _view_threads() == before, timeout=30)
    gone = weakref.ref(session)
    del views, view, session
    gc.collect()
    assert gone() is None  # no view keeps its session alive
