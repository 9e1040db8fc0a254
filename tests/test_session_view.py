"""A session's run in the run's view, fed with its events by hand (no process): rows that say
each rank's state and the cell it runs on a ticking clock, the last outcome, the failure card of
a failed cell with the failed rank's locals, Stop only for a cell run without blocking, Re-form
once the session has ended (one per double click, saying the namespaces are lost), and the same
in words for what shows no widget. One test at the end runs a real session in a real kernel."""
from __future__ import annotations

import re
import time

import ipywidgets as widgets
import pytest

from ddp_notebook.core.errors import DDPNotebookError
from ddp_notebook.core.failures import WorkerFailure
from ddp_notebook.core.stream import EventStream
from ddp_notebook.ui.run_view import RunView
from ddp_notebook.ui.text import format_clock, format_run

T0 = 1_800_000_000.0
DEVICES = ["cpu:0", "cpu:1"]


def session(*events):
    """A session's run, formed at T0 - 30 and ready, then ``events``."""
    feed = EventStream()
    for e in ({"kind": "run_started", "time": T0 - 30, "run_id": "r1", "devices": DEVICES, "backend": "gloo",
               "origin": "session"},
              *({"kind": "started", "time": T0 - 29, "rank": r, "pid": 100 + r} for r in (0, 1)),
              *({"kind": "ready", "time": T0 - 28, "rank": r} for r in (0, 1)), *events):
        feed.emit(e)
    return feed


def request(cell=3, ranks=(0, 1), background=False, first="for i in range(10**9): pass", at=T0):
    return {"kind": "request", "time": at, "what": f"cell {cell}", "cell": cell, "ranks": list(ranks),
            "first_line": first, "background": background}


def cell(n, status="ok", at=T0 + 0.2, **extra):
    return {"kind": "cell", "time": at, "cell": n, "what": f"cell {n}", "ranks": [0, 1], "status": status,
            "code": "x = 1", "seconds": 0.2, **extra}


def cell_failure():
    return WorkerFailure(rank=1, device="cpu:1", kind="exception", time=T0, pid=101, exc_type="ValueError",
                         message="bad shape (3, 3)", traceback="Traceback (most recent call last):\n  ...\n"
                         "ValueError: bad shape (3, 3)",
                         locals={"t": "Tensor[3, 3] float32 cpu", "rank": "1"},
                         locals_frames=[{"function": "<module>", "file": "<ddp cell 4>", "line": 3,
                                         "locals": {"t": "Tensor[3, 3] float32 cpu", "rank": "1"}}])


FAILED_CELL = [request(4), {"kind": "answered", "time": T0 + 0.1, "rank": 0, "status": "done"},
               {"kind": "answered", "time": T0 + 0.2, "rank": 1, "status": "error"},
               cell(4, "failed", message="cell 4 failed on rank 1 (cpu:1): ValueError: bad shape (3, 3). The session "
                    "goes on: its namespaces are kept.", failures=[cell_failure().to_dict()])]


def ended():
    death = WorkerFailure(rank=1, device="cpu:1", kind="signal", time=T0, pid=101, signal="SIGKILL")
    return session({"kind": "failure", "time": T0, "rank": 1, "failure": death.to_dict()},
                   {"kind": "exited", "time": T0, "rank": 1, "code": -9},
                   {"kind": "run_finished", "time": T0 + 1, "status": "failed"})


def text_of(html):
    return re.sub(r"<[^>]+>", "", html).replace("&#x27;", "'").replace("&gt;", ">").replace("&lt;", "<")


def badges(view):
    return [text_of(row.badge.value) for row in view.rows.values()]


@pytest.mark.unit
def test_a_row_per_rank_says_its_state_and_the_cell_it_runs_on_a_clock_that_ticks():
    feed = session(request(3))
    view = RunView(feed, live=False)
    view.refresh(now=T0 + 2.0)
    # No Stop (a click would wait for the blocking cell to end): the line says what stops it.
    assert view.stop_button.layout.display == "none"
    assert "Kernel → Interrupt stops it" in text_of(view.note.value)
    assert badges(view) == ["running", "running"]
    assert "in cell 3 for 2.0 s" in text_of(view.rows[1].text.value) and "pid 101" in text_of(view.rows[1].text.value)
    assert "Running cell 3 on ranks 0, 1 for 2.0 s" in text_of(view.note.value)
    view.refresh(now=T0 + 3.5)  # the clock moves without any event
    assert "in cell 3 for 3.5 s" in text_of(view.rows[1].text.value) and "for 3.5 s" in text_of(view.note.value)
    feed.emit(cell(3, at=T0 + 4))
    view.refresh(now=T0 + 5)
    assert badges(view) == ["idle", "idle"] and "no progress" not in view.rows[0].detail.value
    title = text_of(view.title.value)
    assert title.startswith("Session r1") and "ready" in title and "cpu:0,cpu:1" in title and "1 cell run" in title


@pytest.mark.unit
def test_the_last_outcome_and_a_rank_that_finished_while_the_other_runs():
    feed = session(request(3), {"kind": "answered", "time": T0 + 0.5, "rank": 0, "status": "done"})
    view = RunView(feed, live=False)
    view.refresh(now=T0 + 5)
    assert badges(view) == ["finished", "running"]
    assert "finished cell 3 in 0.5 s, waits" in text_of(view.rows[0].text.value)
    assert "rank 0 finished" in text_of(view.note.value)
    feed.emit(cell(3, at=T0 + 6, values=["[rank 0] 1", "[rank 1] 11"]))
    view.refresh(now=T0 + 6)
    assert "Last: cell 3 on ranks 0, 1: ok in 0.2 s ([rank 0] 1, [rank 1] 11)" in text_of(view.note.value)


@pytest.mark.unit
def test_a_failed_cell_shows_the_runs_failure_card_with_the_failed_ranks_locals():
    feed = session(*FAILED_CELL)
    view = RunView(feed, on_retry=lambda devices: None, live=False)
    card = view.card.value
    assert 'class="ddp-failure"' in card and view.card_box.layout.display == ""
    assert "Distributed data parallel worker 1 (cpu:1) failed: ValueError: bad shape (3, 3)" in text_of(card)
    assert "Locals in <module>" in text_of(card)
    assert "Tensor[3, 3] float32 cpu" in card and 'class="ddp-locals"' in card
    assert badges(view) == ["idle", "failed"] and "2px solid" in view.rows[1].box.layout.border
    assert "ValueError: bad shape (3, 3)" in text_of(view.rows[1].detail.value)
    assert "Last: cell 4 (x = 1) failed on rank 1 (cpu:1)" in text_of(view.note.value)
    assert view.retry_box.layout.display == "none"  # the session goes on: nothing to retry or re-form
    # The hint is a session's (fix the cell, run it again), not a run's (retry on other devices).
    assert "Only rank 1 raised it: compare what it held (its locals below)" in text_of(card)
    assert "run it again: the session goes on" in text_of(card) and "retry" not in card.lower()
    # The next cell runs: the card is folded under a line that names the cell it was (kept: the
    # cells after a failure are often the ones that look into it).
    feed.emit(request(5, at=T0 + 1))
    view.refresh(now=T0 + 1.5)
    assert view.card.value.startswith('<details class="ddp-last-failure">')
    assert "Last failure: cell 4 (x = 1) failed on rank 1 (cpu:1): ValueError: bad shape (3, 3)" in \
        text_of(view.card.value)
    assert badges(view) == ["running", "running"]
    feed.emit(cell(5, at=T0 + 2))
    view.refresh(now=T0 + 3)
    assert view.card.value.startswith('<details class="ddp-last-failure">') and "Tensor[3, 3]" in view.card.value
    assert "Last failure: cell 4 (x = 1) failed on rank 1" in format_run(feed.state)
    # A cell every rank failed the same way is said so, as its error says it (not "on rank 0").
    both = cell_failure()
    both.same_on = DEVICES
    feed.emit(cell(6, "failed", at=T0 + 4, failures=[both.to_dict()]))
    assert "Last: cell 6 (x = 1) failed on every rank (cpu:0, cpu:1) the same way: ValueError: bad shape (3, 3)" in \
        format_run(feed.state)


@pytest.mark.unit
def test_a_cell_being_interrupted_says_so_and_a_cell_run_without_blocking_has_stop():
    feed = session(request(3, background=True))
    view = RunView(feed, live=False)
    assert view.stop_button.layout.display == "" and not view.stop_button.disabled
    assert "Stop or session.interrupt() stops it" in text_of(view.note.value)
    view.stop_button.click()  # no session holds this run (fed by hand): nothing to stop, said
    assert "Nothing to stop" in text_of(view.message.value)
    feed.emit({"kind": "interrupting", "time": T0 + 1, "ranks": [0, 1]})
    view.refresh(now=T0 + 1)
    assert "interrupting on every rank" in text_of(view.note.value) and view.stop_button.disabled
    feed.emit(cell(3, "interrupted", at=T0 + 2, message="Cell 3 interrupted on ranks 0, 1; the session goes on"))
    view.refresh(now=T0 + 2)
    assert view.stop_button.layout.display == "none"
    assert "Last: Cell 3 interrupted on ranks 0, 1; the session goes on" in text_of(view.note.value)


class Reformed:
    """What ``Run.retry`` of a session's run gives: the session formed again (prints as it does)."""

    def __init__(self):
        self.calls = []

    def __call__(self, devices):
        import sys

        self.calls.append(devices)
        print("Session formed again on cpu:0, cpu:1 (run r2, after r1): the ranks' namespaces were lost",
              file=sys.stderr)
        return session()


@pytest.mark.unit
def test_an_ended_session_offers_re_form_which_says_namespaces_are_lost_and_runs_once_per_double_click():
    reformed = Reformed()
    view = RunView(ended(), on_retry=reformed, live=False)
    assert view.retry_box.layout.display == "" and view.reform.layout.display == "" and not view.reform.disabled
    assert "the ranks' namespaces are lost" in text_of(view.retry_note.value)
    assert "killed by signal SIGKILL" in text_of(view.card.value)
    assert "ended" in text_of(view.title.value) and badges(view)[1] == "failed"
    assert "Ended: its ranks are gone" in text_of(view.note.value)
    assert view.retry_single.description == "Re-form on one device"
    view.reform.click()
    view.reform.click()  # the second click of a double click
    assert reformed.calls == [DEVICES]
    assert "Session formed again on cpu:0, cpu:1" in text_of(view.message.value)
    assert "namespaces were lost" in text_of(view.message.value) and "ddp-reformed" in view.message.value
    assert view.reform.disabled


@pytest.mark.unit
def test_re_form_that_fails_says_why():
    def refuse(devices):
        raise DDPNotebookError("the session could not start: no such device")

    view = RunView(ended(), on_retry=refuse, live=False)
    view.reform.click()
    assert "Re-form failed: the session could not start" in text_of(view.message.value)


@pytest.mark.unit
def test_the_fallback_says_the_same_in_words_and_changes_at_status_changes_only():
    feed = session(*FAILED_CELL)
    view = RunView(feed, live=False)
    bundle = view._repr_mimebundle_()
    assert bundle["text/plain"] == repr(view) == format_run(feed.state)
    assert "rank 1 cpu:1        failed in cell 4" in bundle["text/plain"]
    assert "Last: cell 4 (x = 1) failed on rank 1 (cpu:1): ValueError: bad shape (3, 3)" in bundle["text/plain"]
    assert 'class="ddp-failure"' in bundle["text/html"] and "Tensor[3, 3] float32 cpu" in bundle["text/html"]
    keys = [view.status_key()]
    view.refresh(now=T0 + 2)  # a tick: no change
    keys.append(view.status_key())
    feed.emit(request(5, at=T0 + 3))
    keys.append(view.status_key())
    feed.emit(cell(5, at=T0 + 4))
    keys.append(view.status_key())
    assert len(set(keys)) == 3


@pytest.mark.unit
def test_a_sessions_text():
    feed = session(request(3))
    text = format_run(feed.state, now=T0 + 1.25)
    assert text.splitlines() == [
        "Session r1 running on cpu:0,cpu:1 (gloo)",
        "  rank 0 cpu:0 (main) in cell 3 for 1.2 s",
        "  rank 1 cpu:1        in cell 3 for 1.2 s",
        "  Running cell 3 on ranks 0, 1 for 1.2 s (Kernel → Interrupt stops it): for i in range(10**9): pass",
    ]
    text = format_run(ended().state, now=T0)
    assert text.startswith("Session r1 ended") and "rank 1 cpu:1        failed" in text
    assert text.splitlines()[-1].startswith("  Distributed data parallel worker 1 (cpu:1) failed: killed by signal SIGKILL")
    closed = session({"kind": "run_finished", "time": T0, "status": "succeeded"})
    assert format_run(closed.state).splitlines()[0] == "Session r1 closed on cpu:0,cpu:1 (gloo)"
    assert [format_clock(s) for s in (0.04, 2.0, 75, 3720)] == ["0.0 s", "2.0 s", "1 min 15 s", "1 h 2 min"]


@pytest.mark.unit
def test_the_fallback_says_since_when_a_cell_runs_not_a_clock_that_would_stop():
    feed = session(request(5, first="import time"))
    fallback = text_of(RunView(feed, live=False).fallback_html())
    at = time.strftime("%H:%M:%S", time.localtime(T0))
    assert f"Running cell 5 on ranks 0, 1 since {at}" in fallback and f"in cell 5 since {at}" in fallback
    assert " for " not in fallback, fallback
    assert "Running cell 5 on ranks 0, 1 for 2.0 s" in format_run(feed.state, now=T0 + 2)  # print: now


@pytest.mark.unit
def test_markup_in_a_cell_or_its_output_shows_as_text():
    hostile = '<img src=x onerror="alert(1)">'
    feed = session(request(3, first=hostile), *({"kind": "output", "time": T0, "rank": r, "stream": "stdout",
                                                 "text": hostile + "\n"} for r in (0, 1)))
    view = RunView(feed, live=False)
    html = view.note.value + view.rows[0].last.value + view.outputs.children[0].value + view.fallback_html()
    assert "<img" not in html and "&lt;img" in html


@pytest.mark.unit
def test_outside_a_notebook_a_session_shows_its_text(capsys):
    from ddp_notebook.ui.display import show_session

    class NoRun:
        current_run = None

        def __repr__(self):
            return "<a session>"

    show_session(NoRun())  # no run holds its ranks: its repr
    assert capsys.readouterr().out == "<a session>\n"


@pytest.mark.kernel
@pytest.mark.processes
def test_a_real_session_in_a_kernel_shows_its_runs_view_and_its_state_follows_the_cells():
    from session_kernel import Kernel, _all_ended

    from helpers import started_kernel, wait_until

    started = time.monotonic()
    km, kc = started_kernel()
    k, pids = Kernel(km, kc), []
    try:
        views = []

        def hook(msg):
            if msg["msg_type"] in ("display_data", "update_display_data"):
                views.append(msg["content"]["data"])

        reply = kc.execute_interactive("%load_ext ddp_notebook\n%ddp_session cpu*2", timeout=120, output_hook=hook)
        assert reply["content"]["status"] == "ok"
        assert any("application/vnd.jupyter.widget-view+json" in v for v in views), views
        assert views[-1]["text/plain"].startswith("Session "), views[-1]
        pids = k.rank_pids()
        k.execute("%%ddp\nx = torch.zeros(rank + 2)\nif rank == 1:\n    raise ValueError(f'bad {tuple(x.shape)}')")
        printed = k.ok("from ddp_notebook.ui.run_view import RunView\n"
                       "v = RunView(_ddp_session.current_run, live=False)\n"
                       "print(repr(v)); print('CARD', 'Tensor[3] float32 cpu' in v.card.value)")
        assert "rank 1 cpu:1        failed in cell 1" in printed and "ValueError: bad (3,)" in printed, printed
        assert "CARD True" in printed, printed
        printed = k.ok("%%ddp\nx.sum().item()\n")
        printed = k.ok("v.refresh(); print(repr(v))")
        assert "Last: cell 2 on ranks 0, 1: ok in" in printed and "[rank 0] 0.0, [rank 1] 0.0" in printed, printed
        printed = k.ok("%ddp_session --stop\nv.refresh(); print(repr(v))")
        assert " closed on cpu:0,cpu:1" in printed, printed
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    wait_until(lambda: _all_ended(pids), timeout=30)
    assert time.monotonic() - started < 60


@pytest.mark.unit
def test_a_session_view_has_no_button_a_session_cannot_use():
    view = RunView(session(), on_retry=lambda devices: None, live=False)
    shown = [w for w in (view.stop_button, view.reform, view.retry_single) if w.layout.display != "none"
             and view.card_box.layout.display != "none"]
    assert shown == [] and view.stop_button.layout.display == "none"
    assert isinstance(view.reform, widgets.Button)


@pytest.mark.unit
def test_escape_sequences_a_rank_raised_never_reach_the_card_or_its_row():
    f = cell_failure()
    f.message = "bad \x1b[31mred\x1b[0m shape"
    f.traceback = "Traceback (most recent call last):\nValueError: bad \x1b[31mred\x1b[0m shape"
    feed = session(request(4), cell(4, "failed", message="cell 4 failed", failures=[f.to_dict()]))
    view = RunView(feed, live=False)
    assert "\x1b" not in view.card.value + view.rows[1].detail.value and "bad red shape" in view.card.value


@pytest.mark.unit
def test_a_closed_panel_stops_its_views_following_their_runs():
    import threading

    from ddp_notebook.ui.panel import DDPPanel

    def following():
        return sum(1 for t in threading.enumerate() if t.name == "ddp-panel")

    before = following()
    panel = DDPPanel(session(request(3)))  # a live session's run: its view follows it
    assert following() == before + 1
    panel.close()
    deadline = time.monotonic() + 30
    while following() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert following() == before


@pytest.mark.processes
def test_every_view_of_a_session_shows_the_run_it_is_formed_again_on_however_it_was():
    import os
    import signal

    import ddp_notebook
    from ddp_notebook.errors import CellError, SessionEndedError
    from ddp_notebook.ui.panel import DDPPanel

    s = ddp_notebook.session("cpu*2")
    try:
        panels = [DDPPanel(s.current_run) for _ in range(2)]  # as %ddp_session shows it, twice
        first = s.current_run
        s.restart()  # from code or %ddp_session --restart: the old run is closed, the session goes on
        for panel in panels:
            assert [v.run for v in panel.views] == [first, s.current_run]
            assert "Formed again as run " + s.current_run.id in text_of(panel.views[0].note.value)
            assert "Closed" not in text_of(panel.views[0].note.value)
        # A cell leaves rank 0 in a collective the others skip: the session forms itself again.
        second = s.current_run
        with pytest.raises(CellError):
            s.run("if rank == 0:\n    dist.barrier()")
        assert s.current_run is not second
        # A rank killed: the session ended; Re-form from one panel forms it once, shown by both.
        third = s.current_run
        os.kill(third.pids()[1], signal.SIGKILL)
        with pytest.raises(SessionEndedError):
            s.run("import time\ntime.sleep(30)")
        for panel in panels:
            panel.views[-1].refresh()
            assert panel.views[-1].reform.layout.display == "" and not panel.views[-1].reform.disabled
        panels[1].views[-1].on_retry = lambda devices: third.retry(devices=devices)
        panels[1].views[-1].reform.click()
        for panel in panels:
            assert [v.run for v in panel.views][-2:] == [third, s.current_run] and len(panel.views) == 4
            old = panel.views[-2]
            old.refresh()
            assert old.reform.layout.display == "none", panel  # formed again since: nothing to re-form
            assert "Formed again as run " + s.current_run.id in text_of(old.note.value)
        assert s.run("rank") == [0, 1]
    finally:
        s.close()


@pytest.mark.processes
def test_the_notebooks_current_run_follows_its_session_formed_again_from_code(ipython_shell):
    # However the session is formed again (here session.restart() from a cell), ``_ddp_run``,
    # which %ddp_status and %ddp_runs mark, is the run that holds its ranks now.
    ip = ipython_shell
    ip.run_line_magic("load_ext", "ddp_notebook")
    ip.run_line_magic("ddp_session", "cpu*2")
    try:
        s = ip.user_ns["_ddp_session"]
        first = s.current_run
        assert ip.user_ns["_ddp_run"] is first
        s.restart()
        assert s.current_run is not first and ip.user_ns["_ddp_run"] is s.current_run
    finally:
        ip.run_line_magic("ddp_session", "--stop")
