"""Cells run without blocking, in this process with real ranks: the future runs from the start
(``cancel()`` cannot take it back), the session is free when its waiters hear of its end, and
``close()`` with a cell stuck in native code ends the session without forming it again."""
from __future__ import annotations

import contextlib
import gc
import io
import re
import signal
import threading
import time
import traceback
import weakref

import pytest

import ddp_notebook
from ddp_notebook.core.tracebacks import user_frames
from ddp_notebook.errors import SessionBusyError, SessionInterrupted
from ddp_notebook.ui.run_view import RunView

from helpers import wait_until

pytestmark = pytest.mark.processes


def test_a_cell_without_blocking_cannot_be_cancelled_and_frees_the_session_before_its_waiters_hear():
    s = ddp_notebook.session("cpu*2")
    try:
        f = s.run("import time\ntime.sleep(1)\nrank", block=False)
        assert not f.cancel() and f.running()
        for busy in (lambda: s.pull("rank"), lambda: s.push(lr=0.1)):
            with pytest.raises(SessionBusyError, match=r"still running cell 1 \(run without blocking\)") as e:
                busy()
            shown = traceback.extract_tb(user_frames(e.value.__traceback__))  # the frames the notebook shows
            assert {frame.filename for frame in shown} == {__file__}, shown  # the call alone (not contextlib's)
        assert f.result(60) == [0, 1]
        for i in range(40):  # the next request, as soon as a waiter hears: never busy
            f = s.run(f"{i}", block=False)
            f.add_done_callback(lambda done: print("done", flush=True))  # a callback, as the magic adds
            assert f.result(60) == [i, i]
            assert s.run("1") == [1, 1]
    finally:
        s.close()


def test_close_with_a_cell_stuck_in_native_code_ends_the_session_without_forming_it_again():
    s = ddp_notebook.session("cpu*2")
    run = s.current_run
    f = s.run("import os\nos.system('sleep 30')", block=False)
    time.sleep(1)
    started = time.monotonic()
    s.close()
    assert time.monotonic() - started < 40
    with pytest.raises(SessionInterrupted, match="as the session was closed"):
        f.result(5)
    assert s.current_run is run and run.done and not s.alive  # nothing formed again


def test_an_interrupt_while_close_stops_a_cell_run_without_blocking_still_closes_the_session():
    # Kernel → Interrupt while close() waits for the cell it stopped: the ranks were stopped at once
    # (the session "ended", stopped by the user, not closed) and the cell said the session ended.
    s = ddp_notebook.session("cpu*2")
    run = s.current_run
    f = s.run("import time\nfor i in range(600):\n    time.sleep(0.1)", block=False)
    wait_until(lambda: s.state.request is not None, timeout=60)

    interrupt = s.interrupt

    def pressed():  # as close() stops the cell, on its own thread: the press lands inside close()
        signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
        return interrupt()

    s.interrupt = pressed
    s.close()
    assert run.done and s.state.session_status == "closed" and not s.alive, (run.status, run.state.stop_reason)
    with pytest.raises(SessionInterrupted, match=r"the session is being closed|as the session was closed"):
        f.result(5)


def _view_threads():
    return [t for t in threading.enumerate() if t.name == "ddp-panel"]


def test_a_closed_session_leaves_no_thread_of_its_views_and_is_collected():
    before = len(_view_threads())
    s = ddp_notebook.session("cpu*2")
    views = [RunView(s.current_run, live=True) for _ in range(3)]  # as three bare %ddp_session lines make
    wait_until(lambda: len(_view_threads()) == before + 3, timeout=30)  # a live session's clock ticks
    s.close()
    wait_until(lambda: len(_view_threads()) == before, timeout=30)  # its run ended: nothing moves
    assert all("closed" in v.title.value for v in views)
    for view in views:
        view.close()
    gone = weakref.ref(s)
    del s, views, view
    gc.collect()
    assert gone() is None


def test_a_sessions_views_never_keep_it_alive_and_a_closed_view_stops_following():
    before = len(_view_threads())
    s = ddp_notebook.session("cpu*2")
    run = s.current_run
    views = [RunView(run, live=True) for _ in range(2)]
    wait_until(lambda: len(_view_threads()) == before + 2, timeout=30)
    views[0].close()
    wait_until(lambda: len(_view_threads()) == before + 1, timeout=30)
    gone = weakref.ref(s)
    del s
    gc.collect()
    assert gone() is None  # its views hold its run, never the session: its finalizer ended the ranks
    wait_until(lambda: run.done and len(_view_threads()) == before, timeout=60)
    views[1].close()


def test_floods_long_lines_and_odd_characters_are_shown_whole_kept_whole_and_interruptible():
    # What ranks print goes in events gathered for a moment, a print's pieces together, a long
    # write in several, each frame written whole whatever interrupts the rank.
    s = ddp_notebook.session("cpu*2")
    try:
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):
            # The pieces one print writes stay on one line while the other rank prints too.
            assert s.run("for i in range(300):\n    print('L', i)\nrank") == [0, 1]
            lines = [line for line in shown.getvalue().splitlines() if not line.startswith("[rank 0] Out")]
            assert len(lines) == 600 and all(re.fullmatch(r"\[rank [01]\] L \d+", line) for line in lines), lines
            # A 5 MB print: the cell shows its start, the run keeps all of it.
            assert s.run("print('x' * 5_000_000)\n7", ranks=1) == [7]
            assert s.current_run.output(1).count("x") == 5_000_000
            # A lone surrogate is written escaped, and the cell's value still comes back.
            shown.truncate(0)
            assert s.run("print('bad \\ud800 char')\n8") == [8, 8]
            assert "[rank 1] bad \\ud800 char" in shown.getvalue(), shown.getvalue()
            # Lines longer than the pipe holds, interrupted: the session goes on, its namespaces kept.
            for _ in range(3):
                cell = s.run("x = 3\nwhile True:\n    print('y' * 300_000)", block=False)
                time.sleep(0.5)
                assert s.interrupt()
                with pytest.raises(SessionInterrupted, match="the session goes on"):
                    cell.result(timeout=60)
            assert s.run("x") == [3, 3]
    finally:
        s.close()
