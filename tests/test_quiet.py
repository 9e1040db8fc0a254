"""A quiet run, as users see it: a report the throttle held back goes out at the end of its
interval (the rows show the true last step), and a quiet run's rows say which rank holds the
others up, long before the stall watchdog may decide anything, and stop saying it once progress
resumes. The timing of the notes is tested on a fake clock in test_supervisor.py; here with real
workers and gloo, and the context's flusher with real threads (and a real fork)."""
from __future__ import annotations

import inspect
import os
import re
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import ddp_notebook
from ddp_notebook.errors import RunStoppedError
from ddp_notebook.ui.text import format_run
from ddp_notebook.worker.context import WorkerContext

from helpers import wait_for, wait_until


def line_of(fn, marker):
    """The line of ``fn``'s source that holds ``marker`` (a comment), as a stack names it."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, text in enumerate(lines) if marker in text)


def make_context(send, interval):
    return WorkerContext(rank=0, world_size=1, device=torch.device("cpu"), device_name="cpu:0", backend="gloo",
                         run_id="r", run_dir="/nonexistent", send=send, stop_event=threading.Event(),
                         progress_interval=interval)


def flushers():
    return [t for t in threading.enumerate() if t.name == "ddp-progress"]


@pytest.fixture
def flusher_idle_04s(monkeypatch):
    """The flusher leaves after 0.4 s with nothing held, not 1 s: that it leaves is what these
    tests wait for (still longer than their interval: a report after it has left goes out at once)."""
    from ddp_notebook.worker import context

    monkeypatch.setattr(context, "FLUSHER_IDLE", 0.4)


# ---- the throttle's held report ---------------------------------------------------------------------
def test_a_held_report_goes_out_at_the_end_of_its_interval_with_the_metrics_it_carries(flusher_idle_04s):
    sent = []
    ctx = make_context(sent.append, interval=0.3)
    t0 = time.monotonic()
    ctx.log(step=1, total=10, loss=1.0)  # the first goes out at once
    ctx.log(step=2, total=10, acc=0.5)  # held...
    ctx.log(step=3, total=10, loss=0.5)  # ... replaced by this one, which keeps acc
    assert [e["step"] for e in sent] == [1]
    wait_until(lambda: len(sent) == 2, timeout=30)
    assert time.monotonic() - t0 >= 0.3 - 0.01  # not before the interval ended
    assert (sent[1]["step"], sent[1]["metrics"], sent[1].get("held")) == (3, {"acc": 0.5, "loss": 0.5}, None)
    # nothing held any more: the flusher leaves (a rank between runs keeps no thread)
    wait_until(lambda: not flushers(), timeout=30)
    ctx.log(step=4, total=10)  # after the interval: sent at once, no thread needed
    assert sent[-1]["step"] == 4 and not flushers()


def test_a_held_report_sent_by_the_flusher_is_never_overtaken_by_a_later_one(flusher_idle_04s):
    # A slow carrier (a full pipe, a busy engine): while the flusher sends step k, the loop's next
    # report after the interval must wait, or step k would arrive after a later step (each of the
    # flusher's sends, dozens in a second, is such a moment).
    sent = []

    def send(event):
        if threading.current_thread().name == "ddp-progress":
            time.sleep(0.03)
        sent.append(event["step"])

    ctx = make_context(send, interval=0.01)
    end = time.monotonic() + 1.0
    step = 0
    while time.monotonic() < end:
        step += 1
        ctx.log(step=step)
        time.sleep(0.002)
    wait_until(lambda: not flushers(), timeout=30)
    assert len(sent) > 10 and sent == sorted(sent), "a report arrived after a later one"
    assert sent[-1] == step  # the last one goes out, from the flusher


@pytest.mark.processes
def test_a_child_forked_while_the_flusher_sends_can_still_report():
    # The flusher holds the context's lock while it sends; a fork at that moment (a DataLoader
    # worker) must leave the child a lock it can take.
    in_send, release = threading.Event(), threading.Event()
    sent = []

    def send(event):
        if threading.current_thread().name == "ddp-progress" and not release.is_set():
            in_send.set()
            release.wait(30)
        sent.append(event)

    ctx = make_context(send, interval=0.05)
    ctx.log(step=1)
    ctx.log(step=2)  # held: the flusher sends it, and blocks in send
    assert in_send.wait(30)
    pid = os.fork()
    if pid == 0:  # the child: report, flush, leave (0 if it could)
        try:
            ctx.log(step=3, total=3)
            ctx.flush()
            os._exit(0 if sent[-1]["step"] == 3 else 1)
        finally:
            os._exit(2)
    try:
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert done and os.waitstatus_to_exitcode(status) == 0, "the child could not report"
    finally:
        release.set()
        if not done:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    wait_until(lambda: [e["step"] for e in sent] == [1, 2], timeout=30)


# ---- a rank that spins while its peer waits -----------------------------------------------------------
def spin_while_rank_0_waits(ctx, release_file=None):
    t = torch.ones(1)
    ctx.log(step=1, total=1000)
    ctx.log(step=2, total=1000)  # held back by the throttle: sent at the end of its interval
    if ctx.rank == 1:
        while release_file is None or not os.path.exists(release_file): pass  # noqa: E701 SPIN
    dist.all_reduce(t)  # WAIT
    ctx.log(step=3, total=1000)
    if release_file is not None:  # both ranks stay in the function until the test has looked
        while not os.path.exists(release_file + ".end"):
            time.sleep(0.02)
    return t.item()


SPIN = line_of(spin_while_rank_0_waits, "# noqa: E701 SPIN")
WAIT = line_of(spin_while_rank_0_waits, "# WAIT")


def noted(state):
    note = state.quiet_note
    return note is not None and "rank 1 " in note and "rank 0 " in note


@pytest.fixture
def notes_after_2s(monkeypatch):
    """The notes come after 2 s of quiet, not 10 (when they come is the fake clock's test, in
    test_supervisor.py; what they say is this file's): still 20 times the gap between the
    ranks' first reports (0.1 s), after which they are quiet."""
    from ddp_notebook.lifecycle import watchdog

    monkeypatch.setattr(watchdog, "NOTE_AFTER", 2.0)


@pytest.mark.processes
def test_a_spinning_rank_is_named_as_the_one_its_peer_waits_for_and_the_rows_show_the_true_last_step(notes_after_2s):
    run = ddp_notebook.launch(spin_while_rank_0_waits, devices="cpu*2", stall_timeout=None)
    try:
        wait_for(run, noted, timeout=120)
        state = run.state
        note = state.quiet_note
        here = os.path.basename(__file__)
        assert note.startswith(f"rank 0 waits in all_reduce ({here}:{WAIT}) for rank 1; "
                               f"rank 1 runs at {here}:{SPIN}, "), note
        share = int(re.search(r", (\d+) % CPU$", note).group(1))
        assert share >= 20, note  # it spins (on a machine busy with other work, maybe not a whole core)
        assert [w.step for w in run.workers] == [2, 2]  # the held report went out on its own
        text = format_run(state)
        assert f"step 2/1000 (  0%) · waits in all_reduce ({here}:{WAIT}) for rank 1" in text, text
        assert f"step 2/1000 (  0%) · runs at {here}:{SPIN}, {share} % CPU" in text, text
        assert run.status == "running" and not state.failures  # a description, never a failure
    finally:
        run.stop(grace=0)
        with pytest.raises(RunStoppedError):
            run.wait(timeout=60)
    assert run.state.quiet_note is None and "waits in" not in format_run(run.state)


@pytest.mark.processes
def test_the_note_is_cleared_when_progress_resumes(tmp_path, notes_after_2s):
    release = str(tmp_path / "release")
    run = ddp_notebook.launch(spin_while_rank_0_waits, devices="cpu*2", kwargs=dict(release_file=release),
                              stall_timeout=None)
    try:
        wait_for(run, noted, timeout=120)
        open(release, "w").close()  # rank 1 stops spinning: the all_reduce completes, both report step 3
        wait_for(run, lambda s: [w.step for w in s.workers.values()] == [3, 3], timeout=60)
        assert run.status == "running" and run.state.quiet_note is None
        assert all(w.note is None for w in run.workers)
        assert "waits in" not in format_run(run.state) and "runs at" not in format_run(run.state)
        wait_for(run, lambda s: [e["notes"] for e in run.events if e["kind"] == "quiet"][-1] == {}, timeout=60)
        assert [e for e in run.events if e["kind"] == "quiet"][0]["notes"]  # (said, then cleared by the supervisor)
        open(release + ".end", "w").close()
        assert run.wait(timeout=60) == 2.0
    finally:
        open(release, "a").close()
        open(release + ".end", "a").close()
        if not run.done:
            run.stop(grace=0)
            with pytest.raises(RunStoppedError):
                run.wait(timeout=60)
