"""The widget panel: fed events with no kernel, then driven by a real failing 2-worker run."""
import os
import subprocess
import sys

import pytest
import torch  # noqa: F401 - the workers import it; importing here keeps timings comparable

import ddp_notebook
from ddp_notebook.core.failures import WorkerFailure
from ddp_notebook.core.stream import EventStream
from ddp_notebook.ui.panel import DDPPanel
from ddp_notebook.ui.run_view import RunView

import faults

START = {"kind": "run_started", "time": 100.0, "run_id": "r1", "devices": ["cpu:0", "cpu:1"], "backend": "gloo"}


def fed(*events):
    feed = EventStream()
    for e in (START,) + events:
        feed.emit(e)
    return feed


@pytest.fixture
def tick_02s(monkeypatch):
    """A live view ticks every 0.2 s, not every second: the tests that wait for its tick."""
    from ddp_notebook.ui import run_view

    monkeypatch.setattr(run_view, "TICK_S", 0.2)


def test_rows_show_epoch_k_of_n_pace_eta_and_readable_rates_on_one_line():
    feed = fed({"kind": "ready", "time": 100.2, "rank": 0},
               {"kind": "progress", "time": 101.0, "rank": 0, "step": 10, "total": 100, "epoch": 2, "epochs": 8,
                "metrics": {"samples_per_s": 15832.7}},
               {"kind": "progress", "time": 103.0, "rank": 0, "step": 50, "total": 100, "epoch": 2, "epochs": 8})
    view = RunView(feed, live=False)
    text = view.rows[0].text.value
    assert "white-space:nowrap" in text
    assert "epoch 3/8" in text and "20 steps/s, ETA 2 s" in text and "samples/s 15.8k" in view.rows[0].detail.value
    assert "ETA" in view.title.value


def test_the_loss_plot_has_a_log_scale_and_smoothing():
    feed = fed({"kind": "ready", "time": 100.2, "rank": 0},
               *({"kind": "progress", "time": 100.3 + i, "rank": 0, "step": i, "metrics": {"loss": 1.0 / i}}
                 for i in range(1, 60)))
    view = RunView(feed, live=False)
    plain = view.plot.image.value
    view.plot.log_scale.value = True
    logged = view.plot.image.value
    view.plot.smoothed.value = True
    assert plain and logged and len({plain, logged, view.plot.image.value}) == 3


def test_rows_show_progress_and_the_main_worker():
    feed = fed({"kind": "started", "time": 100.1, "rank": 0, "pid": 11},
               {"kind": "ready", "time": 100.2, "rank": 0},
               {"kind": "progress", "time": 101.0, "rank": 0, "step": 5, "total": 20, "epoch": 1,
                "metrics": {"loss": 0.5, "samples_per_s": 1234.0}},
               {"kind": "output", "time": 101.0, "rank": 0, "stream": "stdout", "text": "hello\n"})
    view = RunView(feed, live=False)
    row = view.rows[0]
    assert "main" in row.name.value and "cpu:0" in row.name.value
    assert row.bar.value == 0.25 and row.bar.bar_style == "info"
    assert "step 5/20" in row.text.value and "epoch 1" in row.text.value and "loss 0.5" in row.detail.value
    assert "samples/s 1234" in row.detail.value and "hello" in row.last.value
    assert "running" in row.badge.value and "starting" in view.rows[1].badge.value
    assert view.card_box.layout.display == "none"
    assert view.plot.image.value and view.plot.layout.display == ""  # one loss point plotted
    assert "hello" in view.outputs.children[0].value
    assert repr(view).splitlines()[1].strip().startswith("rank 0 cpu:0 (main) running    step 5/20")


def test_ranks_on_several_hosts_are_grouped_under_their_host():
    feed = EventStream()
    feed.emit(dict(START, devices=["cpu:0", "cpu:1", "cpu:2"], hosts=["h1", "h2", "h1"],
                   places=["engine 0 on h1", "engine 1 on h2", "engine 2 on h1"]))
    view = RunView(feed, live=False)
    children = view.rows_box.children
    assert "<b>host h1</b> · 2 workers<" in children[0].value
    assert children[1] is view.rows[0].box and children[2] is view.rows[2].box and children[4] is view.rows[1].box
    assert "host h2</b> · 1 worker<" in children[3].value
    one_host = RunView(fed(), live=False)
    assert list(one_host.rows_box.children) == [row.box for row in one_host.rows.values()]


def test_failed_worker_turns_red_and_the_card_offers_retries():
    root = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=102.0, pid=12, exc_type="ValueError",
                         message="boom at step 5", traceback='  File "cell", line 3, in train\nValueError: boom\n')
    knock = WorkerFailure(rank=0, device="cpu:0", kind="exception", time=102.1, exc_type="RuntimeError",
                          message="Connection reset by peer", consequence=True)
    feed = fed({"kind": "failure", "time": 102.0, "rank": 1, "failure": root.to_dict()},
               {"kind": "failure", "time": 102.1, "rank": 0, "failure": knock.to_dict()},
               {"kind": "run_finished", "time": 103.0, "status": "failed"})
    retried = []
    view = RunView(feed, on_retry=retried.append, live=False)
    red = view.rows[1]
    assert "#dc3545" in red.box.layout.border and red.bar.bar_style == "danger"
    assert "#dc3545" not in view.rows[0].box.layout.border  # the knock-on peer is not blamed
    assert ">knock-on<" in view.rows[0].badge.value and ">failed<" in red.badge.value
    assert repr(view).splitlines()[1].split()[4] == "knock-on"
    assert view.card_box.layout.display == ""
    assert "Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom at step 5" in view.card.value
    assert "main worker (cpu:0) failed as a consequence" in view.card.value
    assert "Traceback from worker 1" in view.card.value
    assert view.retry_device.value == "cpu:0" and not view.retry_single.disabled
    assert view.retry_box.layout.display == ""  # a ValueError on one rank: a device may be the cause
    view.retry_single.click()
    view.retry_without.click()
    assert retried == [["cpu:0"], ["cpu:0"]]
    assert view.stop_button.layout.display == "none"


@pytest.mark.parametrize("kind", [
    dict(kind="exception", exc_type="TypeError"), dict(kind="result", exc_type="TypeError"),
    dict(kind="unpickle", exc_type="AttributeError"), dict(kind="exception", exc_type="ValueError", same_on=["cpu:0"]),
])
def test_a_failure_of_the_code_offers_no_device_retry(kind):
    f = WorkerFailure(rank=1, device="cpu:1", time=1.0, **kind)
    view = RunView(fed({"kind": "failure", "time": 1, "rank": 1, "failure": f.to_dict()},
                       {"kind": "run_finished", "time": 2.0, "status": "failed"}), on_retry=print, live=False)
    assert f.from_code and view.card_box.layout.display == "" and view.retry_box.layout.display == "none"
    assert "not from a device" in view.card.value or "could not load the function" in view.card.value


@pytest.mark.parametrize("kind, words", [
    (dict(kind="signal", signal="SIGKILL"), "Out of memory"),
    (dict(kind="unpickle", exc_type="AttributeError"), "could not load the function"),
    (dict(kind="stall", stalled_for=3.0), "stopped making progress"),
    (dict(kind="network", message="host h2 (engine 1) has not been heard from for 12 s"), "stopped answering"),
])
def test_card_hint_follows_the_failure_kind(kind, words):
    f = WorkerFailure(rank=1, device="cpu:1", time=1.0, **kind)
    view = RunView(fed({"kind": "failure", "time": 1, "rank": 1, "failure": f.to_dict()}), live=False)
    assert words in view.card.value


@pytest.mark.processes
def test_panel_with_a_real_failing_run_retries_on_one_device():
    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu:0,cpu:1", kwargs={"fault": "raise", "bad_rank": 1})
    panel = DDPPanel(run)
    with pytest.raises(ddp_notebook.WorkerFailedError):
        run.wait(timeout=60)
    view = panel.views[0]
    view.refresh()
    assert "#dc3545" in view.rows[1].box.layout.border
    assert "Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom at step 3" in view.card.value
    assert view.retry_device.value == "cpu:0"
    view.retry_single.click()
    assert len(panel.views) == 2
    retry_view = panel.views[1]
    assert retry_view.run.parent is run and [str(d) for d in retry_view.run.devices] == ["cpu:0"]
    assert retry_view.run.wait(timeout=60) == [1.0, 1.0]
    retry_view.refresh()
    assert "succeeded" in retry_view.title.value and f"retry of {run.id}" in retry_view.title.value
    assert retry_view.rows[0].bar.bar_style == "success" and retry_view.rows[0].bar.value == 1.0
    assert "succeeded" in repr(panel)


def test_launch_controls_validate_before_launching():
    launched = []

    def launcher(devices):
        launched.append(devices)
        return fed()

    panel = DDPPanel(launcher=launcher, available=["cpu:0", "cpu:1", "cpu:2"], selected=["cpu:0", "cpu:1"],
                     validator=ddp_notebook.validate_devices)
    assert panel.chosen_devices() == ["cpu:0", "cpu:1"]
    panel.picker.value = ()
    panel.launch_button.click()
    assert launched == [] and "empty" in panel.report.value and "#dc3545" in panel.report.value
    panel.picker.value = ("cpu:2", "cpu:0")
    panel.launch_button.click()
    assert launched == [["cpu:0", "cpu:2"]]  # ranks follow the picker's order: cpu:0 stays main
    assert len(panel.views) == 1 and "valid" in panel.report.value


def test_the_stopping_note_shows_while_stopping_and_goes_when_the_run_has_stopped():
    feed = fed({"kind": "ready", "time": 100.2, "rank": 0}, {"kind": "ready", "time": 100.2, "rank": 1},
               {"kind": "stopping", "time": 101.0, "reason": "stopped by the user"})
    view = RunView(feed, live=False)
    assert "Stopping (stopped by the user)" in view.note.value
    for event in ({"kind": "done", "time": 101.5, "rank": 0},
                  {"kind": "exited", "time": 102.0, "rank": 1, "exit_code": -15, "by_supervisor": True},
                  {"kind": "run_finished", "time": 102.0, "status": "stopped"}):
        feed.emit(event)
    view.refresh()
    assert view.note.value == "<i>Stopped: stopped by the user.</i>" and "stopped" in view.title.value
    assert [row.badge.value.count(">stopped<") for row in view.rows.values()] == [1, 1]  # not "succeeded"


def test_the_clock_ticks_and_a_silent_rank_is_flagged_without_new_events(tick_02s):
    import time

    now = time.time()
    feed = EventStream()
    feed.emit(dict(START, time=now - 100))
    for rank in (0, 1):
        feed.emit({"kind": "ready", "time": now - 99, "rank": rank})
    for i in range(5):  # reports every 0.5 s, then rank 1 goes quiet for a minute while rank 0 goes on
        feed.emit({"kind": "progress", "time": now - 62 + i * 0.5, "rank": 1, "step": i + 1})
        feed.emit({"kind": "progress", "time": now - 2 + i * 0.3, "rank": 0, "step": i + 1})
    view = RunView(feed, live=True)
    assert "no progress for 60 s" in view.rows[1].detail.value and "no progress" not in view.rows[0].detail.value
    assert "no progress for 60 s" in repr(view)  # the text view says it too
    first = view.title.value
    deadline = time.monotonic() + 30
    while view.title.value == first:  # no event arrives: only the view's own tick can move the clock
        assert time.monotonic() < deadline, "the header clock did not move"
        time.sleep(0.1)


def test_a_quiet_run_says_which_rank_holds_the_others_up_and_stops_saying_it_once_it_goes_on():
    feed = fed({"kind": "ready", "time": 100.2, "rank": 0}, {"kind": "ready", "time": 100.2, "rank": 1},
               {"kind": "quiet", "time": 112.0, "idle": 11.0,
                "notes": {"0": "waits in all_reduce (train.py:9) for rank 1", "1": "runs at train.py:12, 100 % CPU <b>"}})
    view = RunView(feed, live=False)
    assert ("rank 0 waits in all_reduce (train.py:9) for rank 1; rank 1 runs at train.py:12, 100 % CPU &lt;b&gt;"
            in view.note.value)
    assert "waits in all_reduce (train.py:9) for rank 1" in view.rows[0].detail.value
    assert "runs at train.py:12, 100 % CPU" in view.rows[1].detail.value
    feed.emit({"kind": "quiet", "time": 113.0, "idle": None, "notes": {}})
    view.refresh()
    assert view.note.value == "" and "runs at" not in view.rows[1].detail.value


def test_metric_text_from_a_run_is_shown_literally():
    feed = fed({"kind": "ready", "time": 100.2, "rank": 0},
               {"kind": "progress", "time": 101.0, "rank": 0, "metrics": {"<b>x</b>": "<img src=x onerror=alert(1)>"}})
    row = RunView(feed, live=False).rows[0]
    assert "<img" not in row.detail.value and "&lt;img src=x onerror=alert(1)&gt;" in row.detail.value


@pytest.mark.processes
def test_launch_is_off_while_the_panels_run_goes_on_and_a_second_click_starts_nothing():
    started = []

    def launcher(devices):
        return ddp_notebook.launch(faults.wait_for_stop, devices=devices)

    panel = DDPPanel(launcher=launcher, available=["cpu:0", "cpu:1"], selected=["cpu:0", "cpu:1"],
                     validator=ddp_notebook.validate_devices, on_start=started.append)
    assert not panel.launch_button.disabled
    panel.launch_button.click()
    panel.launch_button.click()  # a double click: the second reaches the kernel before the button is off
    assert len(started) == 1 and len(panel.views) == 1 and panel.launch_button.disabled
    assert panel.report.value.startswith('<div class="ddp-report">')  # ignored, as part of the same click sequence
    run = started[0]
    panel.launches.sequence_s = 0.0  # a click well after it: refused while the run goes on
    panel.launch_button.click()
    assert len(started) == 1
    assert f"Run {run.id} is still" in panel.report.value and "stop it before launching another" in panel.report.value
    run.stop(grace=20, wait=True)
    assert not panel.launch_button.disabled  # on again once the run has ended
    assert panel.report.value == ""  # and the refusal, no longer true, is gone


def test_the_title_says_data_is_being_sent_then_what_was_sent():
    sending = {"kind": "data", "time": 100.1, "total": 4_000_000_000, "sent": 1_200_000_000, "files": [],
               "in_place": 0}
    feed = fed(sending)
    view = RunView(feed, live=False)
    assert "sending data 1.2 GB/4 GB" in view.title.value
    feed.emit(dict(sending, time=101.4, sent=4_000_000_000, seconds=1.3, files=["/data/<tokens>.bin"]))
    view.refresh()
    assert ("data: 4 GB copied to shared memory in 1.3 s (held twice while the run lives: ddp_notebook.share() holds "
            "it once), /data/&lt;tokens&gt;.bin mapped from its file") in view.title.value


@pytest.mark.processes
def fails_then_waits(ctx, marker):
    """Rank 1 of two raises; a run on one device waits for ``marker`` (the test says when it ends)."""
    import time

    import torch.distributed as dist

    if ctx.world_size > 1:
        if ctx.rank == 1:
            raise ValueError("boom")
        dist.barrier()
    while not os.path.exists(marker):
        time.sleep(0.01)
    return ctx.world_size


def test_a_double_click_on_retry_starts_one_retry_from_one_thread_or_two(tmp_path):
    import threading

    from helpers import started_processes, wait_until

    before = started_processes()
    marker = str(tmp_path / "go")
    run = ddp_notebook.launch(fails_then_waits, devices="cpu:0,cpu:1", args=(marker,))
    panel = DDPPanel(run)
    with pytest.raises(ddp_notebook.WorkerFailedError):
        run.wait(timeout=60)
    view = panel.views[0]
    view.refresh()
    assert not view.retry_single.disabled
    view.retry_single.click()
    view.retry_single.click()  # a double click: the second reaches the kernel before the button is off
    # (the retry waits for the marker: it goes on while this is checked)
    assert len(panel.views) == 2 and view.retry_single.disabled and view.retry_without.disabled
    retry = panel.views[1].run
    open(marker, "w").close()
    assert retry.wait(timeout=60) == 1
    wait_until(lambda: not view.retry_single.disabled)  # on again once the retry has ended
    view.retries.sequence_s = 0.0  # the double click's sequence is over (without waiting for it to be)
    clicks = [threading.Thread(target=view.retry_single.click) for _ in range(2)]  # two threads at once
    for t in clicks:
        t.start()
    for t in clicks:
        t.join(timeout=60)
    assert len(panel.views) == 3
    assert panel.views[2].run.wait(timeout=60) == 1
    wait_until(lambda: started_processes() <= before)  # every worker ended


def test_start_guard_refuses_while_its_run_goes_on_and_ignores_a_second_click():
    from ddp_notebook.ui.run_view import StartGuard

    guard = StartGuard("retrying again", sequence_s=3600.0)
    feed = fed()
    assert guard.start(lambda: feed) == (feed, "")
    assert guard.start(lambda: fed()) == (None, "")  # the same click sequence: ignored
    guard.sequence_s = 0.0
    assert guard.start(lambda: fed()) == (None, "Run r1 is still starting: stop it before retrying again.")
    feed.emit({"kind": "run_finished", "time": 101.0, "status": "failed"})
    again = fed()
    assert guard.start(lambda: again) == (again, "")


def test_the_last_line_skips_warnings_and_the_row_counts_them():
    feed = fed({"kind": "ready", "time": 100.2, "rank": 0},
               {"kind": "output", "time": 101.0, "rank": 0, "stream": "stdout", "text": "epoch 1 done\n"},
               {"kind": "output", "time": 101.1, "rank": 0, "stream": "stderr",
                "text": "/lib/x.py:12: DeprecationWarning: old api\n  old_api()\n"},
               {"kind": "output", "time": 101.2, "rank": 1, "stream": "stderr", "text": "Traceback: boom\n"})
    view = RunView(feed, live=False)
    assert "epoch 1 done" in view.rows[0].last.value and "DeprecationWarning" not in view.rows[0].last.value
    assert "1 warning" in view.rows[0].detail.value
    assert "Traceback: boom" in view.rows[1].last.value and "#dc3545" in view.rows[1].last.value  # stderr in red
    engines = EventStream()
    engines.emit(dict(START, places=["engine 0 on host-a", "engine 1 on host-b"]))
    row = RunView(engines, live=False).rows[1]
    assert "<br>" not in row.name.value and "engine 1 on host-b" in row.detail.value  # one line of columns


def test_a_fit_gets_an_epoch_table_and_plot_and_the_fallback_says_the_outcome():
    records = [{"epoch": e, "seconds": 1.5, "loss_mean": 1.0 / (e + 1),
                "metrics": {"train_loss": 1.0 / (e + 1), "valid_loss": 1.2 / (e + 1), "acc": 0.5 + e / 10,
                            "samples_per_s": 100.0}} for e in range(3)]
    feed = fed({"kind": "ready", "time": 100.2, "rank": 0},
               {"kind": "progress", "time": 101.0, "rank": 0, "step": 30, "total": 40, "epoch": 2, "epochs": 4,
                "metrics": {"loss": 0.3}, "loss_bins": [[s, 1.0 / s] for s in range(1, 31)],
                "epoch_records": records})
    view = RunView(feed, live=False)
    table = view.epoch_table.value
    for text in ("<th", "train loss", "valid loss", ">acc<", ">time<", ">1/4<", ">0.5<", "1.5 s", "3/4 (running)"):
        assert text in table, text
    assert "samples" not in table and view.epoch_plot.value and view.epoch_plot.layout.display == ""
    assert len(feed.state.workers[0].loss_history) == 30  # every step, from the bins
    assert "starting" in view.fallback_html() or "running" in view.fallback_html()
    feed.emit({"kind": "failure", "time": 102.0, "rank": 0, "failure": WorkerFailure(
        rank=0, device="cpu:0", kind="exception", time=102.0, exc_type="ValueError", message="boom").to_dict()})
    feed.emit({"kind": "run_finished", "time": 103.0, "status": "failed"})
    view.refresh()
    assert "3/4 (cut short)" in view.epoch_table.value
    assert "failed" in view.fallback_html() and "ValueError: boom" in view.fallback_html()
    bundle = view._repr_mimebundle_()
    assert "failed" in bundle["text/plain"] and bundle["text/html"] == view.fallback_html()


def test_a_live_view_renders_its_liveness_every_tick_and_a_finished_one_none(tick_02s):
    import time

    from helpers import wait_until

    feed = fed({"kind": "ready", "time": time.time(), "rank": 0})
    view = RunView(feed, live=True)
    first = view.live.value
    assert "<style>" in first and "@keyframes" in first and f"ddp-view-{view.token}" in first
    assert f"ddp-view-{view.token}" in view._dom_classes and "ddp-dims" in view.stop_button._dom_classes
    wait_until(lambda: view.live.value != first)  # the next tick, with no event: a new value
    feed.emit({"kind": "run_finished", "time": time.time(), "status": "stopped"})
    wait_until(lambda: view.live.value == "")


def test_the_panel_sends_its_display_again_at_status_changes_only_and_its_end_at_once():
    import threading

    from helpers import wait_until

    sent = []
    feed = fed()
    panel = DDPPanel(feed)
    panel.keep_current(lambda shown: sent.append((threading.current_thread().name, repr(shown))))
    wait_until(lambda: len(sent) == 1)  # the display's thread sends what shows now
    assert sent[0][0] == "ddp-display" and "starting" in sent[0][1]
    for t in range(5):  # reports: no status change, no update
        feed.emit({"kind": "progress", "time": 100.1 + t, "rank": 0, "step": t})
    feed.emit({"kind": "ready", "time": 101.0, "rank": 0})
    wait_until(lambda: len(sent) == 2)
    assert sent[1][0] == "ddp-display" and "running" in sent[1][1]  # (a report sent would have come first)
    # The end: sent at once, by the thread that emitted it (its cell keeps it), before a wait() can return.
    feed.emit({"kind": "run_finished", "time": 103.0, "status": "succeeded"})
    assert len(sent) == 3 and sent[2][0] == threading.current_thread().name and "succeeded" in sent[2][1]
    wait_until(lambda: panel._follower is None)  # the display's thread ended with the run
    assert len(sent) == 3


def test_a_run_shown_after_the_others_ended_is_kept_current_too():
    from helpers import wait_until

    sent = []
    first = fed()
    panel = DDPPanel(first)
    panel.keep_current(lambda shown: sent.append(repr(shown)))
    first.emit({"kind": "run_finished", "time": 103.0, "status": "failed"})
    wait_until(lambda: panel._follower is None)
    later = fed()  # a retry, or a session formed again, shown below
    panel.show(later)
    later.emit({"kind": "ready", "time": 101.0, "rank": 0})
    wait_until(lambda: "running" in sent[-1])  # sent by a display thread of its own
    later.emit({"kind": "run_finished", "time": 104.0, "status": "succeeded"})
    assert sent[-1].count("succeeded") == 1
    wait_until(lambda: panel._follower is None)


def test_a_runs_thread_never_waits_on_a_display_while_the_run_goes_on():
    import threading

    from helpers import wait_until

    drawing, release = threading.Event(), threading.Event()
    sent = []

    def slow(shown):  # a display that takes its time (a drawing)
        drawing.set()
        release.wait(60)
        sent.append(repr(shown))

    feed = fed()
    panel = DDPPanel(feed)
    panel.keep_current(slow)
    assert drawing.wait(30)  # the display's thread is drawing
    emitter = threading.Thread(target=feed.emit, args=({"kind": "ready", "time": 101.0, "rank": 0},), daemon=True)
    emitter.start()  # the run's supervising thread: a status change
    emitter.join(30)
    alive = emitter.is_alive()
    release.set()
    assert not alive
    wait_until(lambda: any("running" in text for text in sent))  # the change, sent once the drawing ended
    feed.emit({"kind": "run_finished", "time": 103.0, "status": "stopped"})
    wait_until(lambda: panel._follower is None)


def test_a_display_that_fails_to_send_is_logged_and_a_closed_panel_no_longer_sent(caplog):
    from helpers import wait_until

    calls = []

    def broken(shown):
        calls.append(1)
        raise TypeError("a front end's failure")

    feed = fed()
    panel = DDPPanel(feed)
    with caplog.at_level("ERROR", logger="ddp_notebook.ui.panel"):
        panel.keep_current(broken)
        wait_until(lambda: panel._follower is None)  # the display's thread ended, said why
    assert calls == [1] and "a display of runs could not be sent" in caplog.text
    feed.emit({"kind": "ready", "time": 101.0, "rank": 0})  # the next change: a thread of its own again
    wait_until(lambda: len(calls) == 2 and panel._follower is None)
    panel.close()
    feed.emit({"kind": "run_finished", "time": 103.0, "status": "stopped"})
    assert len(calls) == 2


@pytest.mark.unit
def test_the_output_tab_says_how_many_earlier_lines_it_does_not_show():
    text = "".join(f"line {i}\n" for i in range(1000))
    view = RunView(fed({"kind": "output", "time": 101.0, "rank": 0, "stream": "stdout", "text": text}), live=False)
    shown = view.outputs.children[0].value
    assert "800 earlier lines not shown: run.output(0) has them all" in shown and "line 999" in shown
    assert "line 799" not in shown
    few = RunView(fed({"kind": "output", "time": 101.0, "rank": 0, "stream": "stdout", "text": "one\n"}), live=False)
    assert "not shown" not in few.outputs.children[0].value


@pytest.mark.unit
def test_the_loss_plots_steps_read_as_people_read_them():
    from ddp_notebook.ui.loss_plot import step_label

    assert [step_label(x) for x in (0.0, 20000.0, 100000.0, 1_500_000.0)] == ["0", "20k", "100k", "1.5M"]


@pytest.mark.unit
def test_the_panel_shows_at_once_and_offers_the_devices_it_finds_later_the_choice_kept():
    import threading
    import time

    found = threading.Event()

    def slowly():  # as finding the GPUs is where the notebook has not imported torch
        found.wait(30)
        return ["cuda:0", "cpu:0", "cpu:1", "cpu:2"]

    panel = DDPPanel(launcher=lambda devices: fed(), available=slowly, selected=["cpu:0", "cpu:1"],
                     validator=ddp_notebook.validate_devices)
    assert list(panel.picker.options) == ["cpu:0", "cpu:1"] and panel.chosen_devices() == ["cpu:0", "cpu:1"]
    found.set()
    deadline = time.monotonic() + 30
    while len(panel.picker.options) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(panel.picker.options) == ["cuda:0", "cpu:0", "cpu:1", "cpu:2"]
    assert panel.chosen_devices() == ["cpu:0", "cpu:1"]  # the choice kept


CHILD_DRAWING_AT_EXIT = """
import threading, time
from ddp_notebook.ui.loss_plot import plot_png
series = {"rank 0": [(float(i), 1.0 / (i + 1)) for i in range(2000)]}
def draw():
    while True:
        plot_png(series, True, True)
for _ in range(4):
    threading.Thread(target=draw, daemon=True).start()
time.sleep(PAUSE)
"""


@pytest.mark.processes
def test_the_interpreter_exits_cleanly_while_views_draw_their_plots():
    # A view's thread drawing, or importing matplotlib, as Python exits was ended inside matplotlib's
    # C++: exit 134 ("terminate called without an active exception", "PyThreadState_Get") or 139.
    for pause in (0.0, 0.5, 0.0, 0.5):  # (0: the drawers are still importing matplotlib)
        child = subprocess.run([sys.executable, "-c", CHILD_DRAWING_AT_EXIT.replace("PAUSE", str(pause))],
                               capture_output=True, text=True, timeout=120)
        assert child.returncode == 0, child.stderr[-2000:]


@pytest.mark.processes
def test_a_run_started_again_after_its_failure_shows_below_it():
    run = ddp_notebook.launch(faults.fails_until_resumed, devices="cpu*2", kwargs={"times": 1}, max_restarts=1)
    panel = DDPPanel(run)
    assert run.wait(timeout=120) == 2
    assert [v.run for v in panel.views] == [run, run.restarted]
    panel.views[1].refresh()
    assert "succeeded" in panel.views[1].title.value and f"retry of {run.id}" in panel.views[1].title.value
