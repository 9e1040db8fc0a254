import pytest

from ddp_notebook.core.failures import WorkerFailure
from ddp_notebook.core.state import RunState

pytestmark = pytest.mark.unit


def feed(*events):
    s = RunState()
    for e in events:
        s.apply(e)
    return s


START = {"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"], "backend": "gloo"}


def test_progress_output_and_success():
    s = feed(START,
             {"kind": "started", "time": 0.1, "rank": 0, "pid": 10},
             {"kind": "ready", "time": 0.2, "rank": 0},
             {"kind": "progress", "time": 0.3, "rank": 0, "step": 1, "total": 4, "epoch": 0, "metrics": {"loss": 2.0}},
             {"kind": "progress", "time": 0.4, "rank": 0, "step": 2, "metrics": {"acc": 0.5}},
             {"kind": "output", "time": 0.4, "rank": 1, "stream": "stderr", "text": "warn a\nwarn b\n"},
             {"kind": "done", "time": 0.5, "rank": 0},
             {"kind": "run_finished", "time": 0.6, "status": "succeeded"})
    w0, w1 = s.workers[0], s.workers[1]
    assert (w0.pid, w0.step, w0.total, w0.epoch, w0.status) == (10, 2, 4, 0, "succeeded")
    assert w0.metrics == {"loss": 2.0, "acc": 0.5} and w0.is_main
    assert w1.stderr_tail() == ["warn a", "warn b"] and w1.status == "starting"
    assert s.status == "succeeded" and s.finished and s.world_size == 2


def test_a_progress_bar_and_coloured_output_are_kept_as_a_terminal_shows_them():
    def out(text, stream="stderr"):
        return {"kind": "output", "time": 0.4, "rank": 0, "stream": stream, "text": text}

    s = feed(START, out("\x1b[?25l\x1b[2KEpoch 0 \x1b[35m━\x1b[0m 1/4"), out("\r\x1b[2KEpoch 0 \x1b[35m━━\x1b[0m 2/4"),
             out("\r\x1b[2KEpoch 0 \x1b[35m━━━━\x1b[0m 4/4\n\x1b[?25h"), out("\x1b[33mWARNING\x1b[0m: slow\n"),
             out("printed\n", stream="stdout"), out("tqdm 10%\r"), out("tqdm 50%\r"))
    assert list(s.workers[0].output) == [("stderr", "Epoch 0 ━━━━ 4/4"), ("stderr", "WARNING: slow"),
                                         ("stdout", "printed"), ("stderr", "tqdm 50%")]
    assert s.workers[0].last_line == "tqdm 50%"


def test_failure_and_stopped_peer():
    f = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=1.0, exc_type="ValueError", message="boom")
    g = WorkerFailure(rank=0, device="cpu:0", kind="exception", time=1.1, exc_type="RuntimeError",
                      message="reset", consequence=True)
    s = feed(START, {"kind": "failure", "time": 1, "rank": 1, "failure": f.to_dict()},
             {"kind": "failure", "time": 1, "rank": 0, "failure": g.to_dict()},
             {"kind": "exited", "time": 2, "rank": 1, "exit_code": 1, "by_supervisor": False},
             {"kind": "run_finished", "time": 3, "status": "failed"})
    assert s.root_failure.rank == 1 and s.workers[1].status == "failed"
    assert (s.workers[0].status, s.workers[0].shown_status, s.workers[1].shown_status) == ("failed", "knock-on",
                                                                                         "failed")
    s2 = feed(START, {"kind": "exited", "time": 2, "rank": 0, "exit_code": -15, "by_supervisor": True})
    assert s2.workers[0].status == "stopped"


def test_the_text_view_says_a_run_is_stopping_and_gives_no_eta_meanwhile():
    from ddp_notebook.ui.text import format_run

    progress = [{"kind": "started", "time": 0.1, "rank": r, "pid": 10 + r} for r in (0, 1)] + \
        [{"kind": "ready", "time": 0.15, "rank": r} for r in (0, 1)] + \
        [{"kind": "progress", "time": 0.2 + t, "rank": r, "step": t + 1, "total": 100} for t in range(3) for r in (0, 1)]
    running = feed(START, *progress)
    assert "running" in format_run(running, now=3.0).splitlines()[0] and "ETA" in format_run(running, now=3.0)
    stopping = feed(START, *progress, {"kind": "stopping", "time": 3.0, "reason": "stopped by the user"})
    head = format_run(stopping, now=3.5).splitlines()[0]
    assert head.startswith("Run r stopping (stopped by the user) after 3.5 s") and "ETA" not in head


def test_a_sessions_cells_are_folded_with_the_failure_of_the_last_that_failed():
    s = RunState()
    s.apply({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"], "origin": "session"})
    failure = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=2.0, exc_type="ValueError", message="bad",
                            locals={"t": "Tensor[3] float32 cpu"})
    s.apply({"kind": "cell", "time": 1.0, "cell": 1, "ranks": [0, 1], "status": "ok", "code": "x = 1", "seconds": 0.1})
    s.apply({"kind": "cell", "time": 2.0, "cell": 2, "ranks": [0, 1], "status": "failed", "code": "t.view(2)",
             "seconds": 0.2, "message": "cell 2 failed on rank 1", "failures": [failure.to_dict()]})
    s.apply({"kind": "cell", "time": 3.0, "cell": 3, "ranks": [1], "status": "interrupted", "code": "loop()",
             "failures": [{"not": "a failure"}]})  # a record this version cannot read: the rest still is
    assert s.cells == 3 and [c.status for c in s.cell_records] == ["ok", "failed", "interrupted"]
    failed = s.failed_cell
    assert (failed.cell, failed.code, failed.failures[0].locals) == (2, "t.view(2)", {"t": "Tensor[3] float32 cpu"})
    assert RunState().failed_cell is None


def test_an_event_after_the_runs_end_is_folded_and_added_to_its_closed_log(tmp_path):
    import json

    from ddp_notebook.core.stream import EventStream

    path = tmp_path / "events.jsonl"
    stream = EventStream(open(path, "a", buffering=1))
    stream.emit({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0"], "origin": "session"})
    stream.emit({"kind": "run_finished", "time": 1.0, "status": "failed"})
    stream.close()
    added = []

    def append(line):
        added.append(line)
        with open(path, "a") as f:
            f.write(line)

    stream.emit_late({"kind": "cell", "time": 2.0, "cell": 4, "ranks": [0], "status": "ended", "code": "x"}, append)
    assert stream.state.cell_records[-1].status == "ended" and len(added) == 1
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["run_started", "run_finished", "cell"]
    live = EventStream(open(tmp_path / "other.jsonl", "a", buffering=1))  # a live log writes it itself
    live.emit_late({"kind": "cell", "time": 2.0, "cell": 1, "ranks": [0], "status": "ok", "code": "y"}, added.append)
    assert len(added) == 1 and '"cell"' in (tmp_path / "other.jsonl").read_text()


def test_a_sessions_request_in_flight_is_folded_from_its_runs_events_and_its_end_kept():
    s = RunState()
    s.apply({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"]})
    s.apply({"kind": "request", "time": 1.0, "what": "cell 3", "cell": 3, "ranks": [0, 1],
             "first_line": "x = rank", "background": True})
    s.apply({"kind": "answered", "time": 1.5, "rank": 1, "status": "done"})
    s.apply({"kind": "interrupting", "time": 2.0, "ranks": [0]})
    request = s.request
    assert (request.what, request.cell, request.ranks, request.background, request.interrupting) == \
        ("cell 3", 3, [0, 1], True, True)
    assert request.answered == {1: ("done", 1.5)}
    s.apply({"kind": "cell", "time": 2.5, "cell": 3, "what": "cell 3", "ranks": [0, 1], "status": "interrupted",
             "code": "x = rank", "seconds": 1.5, "values": ["[rank 1] 1"]})
    assert s.request is None and s.cells == 1 and s.last_request.status == "interrupted"
    s.apply({"kind": "request", "time": 3.0, "what": "push lr", "cell": None, "ranks": [0, 1]})
    s.apply({"kind": "cell", "time": 3.1, "cell": None, "what": "push lr", "ranks": [0, 1], "status": "ok"})
    assert s.cells == 1 and len(s.cell_records) == 1 and s.last_request.what == "push lr"  # a push is no cell
    s.apply({"kind": "request", "time": 4.0, "what": "cell 4", "cell": 4, "ranks": [0]})
    s.apply({"kind": "run_finished", "time": 5.0, "status": "failed"})
    assert s.request is None  # what ran ended with the ranks


def test_a_session_runs_text_and_panel_say_the_request_in_flight_and_how_the_last_ended():
    from ddp_notebook.ui.text import format_run, session_lines

    s = RunState()
    s.apply({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"], "origin": "session"})
    assert session_lines(s) == []
    s.apply({"kind": "request", "time": 1.0, "what": "cell 1", "cell": 1, "ranks": [0, 1]})
    s.apply({"kind": "answered", "time": 1.2, "rank": 0, "status": "error"})
    s.apply({"kind": "interrupting", "time": 1.7, "ranks": [1]})
    assert "Running cell 1 on ranks 0, 1 for 4.0 s (rank 0 failed; interrupting on every rank)" in \
        format_run(s, now=5.0)
    s.apply({"kind": "cell", "time": 6.0, "cell": 1, "what": "cell 1", "ranks": [0, 1], "status": "interrupted",
             "seconds": 5.0})
    assert session_lines(s) == ["Last: cell 1 on ranks 0, 1: interrupted after 5.0 s"]


def test_a_session_runs_rows_say_idle_or_the_request_never_no_progress_between_cells():
    from ddp_notebook.ui.text import format_run

    s = RunState()
    s.apply({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"], "origin": "session"})
    for r in (0, 1):
        s.apply({"kind": "ready", "time": 0.5, "rank": r})
    s.apply({"kind": "request", "time": 100.0, "what": "cell 2", "cell": 2, "ranks": [0, 1]})
    s.apply({"kind": "answered", "time": 100.5, "rank": 1, "status": "done"})
    text = format_run(s, now=101.0)
    assert "rank 0 cpu:0 (main) in cell 2" in text and "rank 1 cpu:1        finished cell 2" in text, text
    s.apply({"kind": "cell", "time": 101.0, "cell": 2, "what": "cell 2", "ranks": [0, 1], "status": "ok"})
    text = format_run(s, now=500.0)  # idle for minutes between cells: no "no progress"
    assert sum(line.rstrip().endswith(" idle") for line in text.splitlines()) == 2 and "no progress" not in text, text


def test_a_session_rank_that_left_an_interrupted_cell_is_said_interrupted_not_failed():
    from ddp_notebook.ui.text import session_lines

    s = RunState()
    s.apply({"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"], "origin": "session"})
    s.apply({"kind": "request", "time": 1.0, "what": "cell 2", "cell": 2, "ranks": [0, 1]})
    s.apply({"kind": "answered", "time": 2.0, "rank": 0, "status": "interrupted"})
    s.apply({"kind": "answered", "time": 2.0, "rank": 1, "status": "error"})
    assert (s.session_activity(0), s.session_activity(1)) == ("interrupted in cell 2", "failed in cell 2")
    assert session_lines(s, now=3.0)[0].endswith("(rank 1 failed; rank 0 interrupted; Kernel → Interrupt stops it)")


def test_epochs_logged_from_1_outside_ctx_epochs_never_show_one_past_the_last():
    # for epoch in range(3): ctx.log(epoch=epoch + 1, epochs=3): the last shows as 3/3, not 4/3.
    from ddp_notebook.ui.html import epoch_table_html
    from ddp_notebook.ui.text import format_run

    s = feed(START, {"kind": "started", "time": 0.1, "rank": 0, "pid": 10}, {"kind": "ready", "time": 0.2, "rank": 0},
             *({"kind": "progress", "time": 0.3 + e, "rank": 0, "epoch": e, "epochs": 3, "metrics": {"loss": 1.0}}
               for e in (1, 2, 3)))
    assert s.workers[0].epoch_text == "epoch 3/3"
    assert "epoch 3/3" in format_run(s) and "4/3" not in format_run(s)
    table = epoch_table_html([{"epoch": e, "train_loss": 1.0} for e in (1, 2, 3)], epochs=3)
    assert "3/3" in table and "4/3" not in table
