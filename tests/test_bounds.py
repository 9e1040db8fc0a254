"""What a run may hold in the notebook (core.bounds, core.stream): one event's texts are cut, the
stream keeps every lifecycle event but only the recent progress and output, and the log on disk
stops taking progress and output at its limit, saying so."""
import json

import pytest

import ddp_notebook
from ddp_notebook.core import bounds
from ddp_notebook.core.bounds import bound_event
from ddp_notebook.core.stream import EventStream

import faults


def _started():
    return {"kind": "run_started", "time": 0.0, "run_id": "r", "devices": ["cpu:0", "cpu:1"]}


@pytest.mark.unit
def test_each_text_of_an_event_is_cut_and_says_so():
    event = bound_event({"kind": "progress", "rank": 0, "metrics": {"x" * 500: 1, "s": "y" * 10**6, "loss": 0.5}})
    (name, _), (_, s), loss = event["metrics"].items()
    assert len(name) < 200 and name.endswith("[400 more characters not kept]")
    assert s.startswith("y" * bounds.METRIC_CHARS) and s.endswith(f"[{10**6 - bounds.METRIC_CHARS} more characters not kept]")
    assert loss == ("loss", 0.5)
    error = bound_event({"kind": "error", "message": "head " + "z" * 10**6 + " the end", "traceback": "t"})
    assert error["message"].startswith("head ") and error["message"].endswith(" the end")
    assert len(error["message"]) < bounds.TEXT_CHARS + 100
    many = bound_event({"kind": "progress", "metrics": {f"m{i}": i for i in range(10**5)}})
    assert len(many["metrics"]) == bounds.METRICS_KEPT and "m0" in many["metrics"]
    small = {"kind": "output", "text": "hello\n"}
    assert bound_event(small) is small  # nothing too long: no copy


@pytest.mark.unit
def test_a_cut_name_is_not_cut_again_when_a_held_report_is_merged_into_the_next():
    once = bounds.bound_metrics({"N" * 5000: 1.0})
    assert bounds.bound_metrics(dict(once, **once)) == once and list(once)[0].endswith("[4900 more characters not kept]")


@pytest.mark.unit
def test_a_metric_beyond_a_floats_range_is_shown_as_infinite_and_never_breaks_the_views():
    from ddp_notebook.core.events import to_json_value
    from ddp_notebook.core.state import RunState
    from ddp_notebook.ui.text import format_metric, format_run

    assert (to_json_value(10**400), to_json_value(-10**400), to_json_value(2**62)) == ("inf", "-inf", 2**62)
    state = RunState()
    for event in (_started(), {"kind": "progress", "time": 1.0, "rank": 0, "step": 1, "metrics": {"loss": 10**400,
                                                                                                   "n": -10**400}}):
        state.apply(event)  # (an old log may hold such an int)
    assert "-1.00e+400" in format_run(state, now=2.0) and format_metric(10**400) == "1.00e+400"


@pytest.mark.unit
def test_memory_keeps_every_lifecycle_event_and_the_recent_progress_and_output(monkeypatch, tmp_path):
    monkeypatch.setattr(bounds, "TAIL_EVENTS", 100)
    monkeypatch.setattr(bounds, "LOG_BYTES", 10**9)
    log = open(tmp_path / "events.jsonl", "a", buffering=1)
    stream = EventStream(log)
    stream.emit(_started())
    for step in range(1, 1001):
        stream.emit({"kind": "progress", "time": float(step), "rank": step % 2, "step": step,
                     "metrics": {f"name{step}": step}})  # a new name each step
        if step == 500:
            stream.emit({"kind": "checkpoint", "time": 500.0, "rank": 0, "epoch": 1, "path": "p"})
    kinds = [e["kind"] for e in stream.events]
    assert kinds.count("progress") <= 100 and stream.dropped == 1000 - kinds.count("progress")
    assert kinds[0] == "run_started" and "checkpoint" in kinds
    assert stream.events[-1]["step"] == 1000  # the most recent are the ones kept
    assert stream.state.workers[0].step == 1000 and len(stream.state.checkpoints) == 1  # the state saw all
    assert len(stream.state.workers[0].metrics) == bounds.METRICS_KEPT
    log.close()
    assert sum(1 for _ in open(tmp_path / "events.jsonl")) == 1002  # the log has everything


@pytest.mark.unit
def test_memory_is_bounded_in_bytes_too(monkeypatch):
    monkeypatch.setattr(bounds, "TAIL_BYTES", 1 << 20)
    stream = EventStream()
    stream.emit(_started())
    for i in range(200):
        stream.emit({"kind": "output", "time": float(i), "rank": 0, "stream": "stdout", "text": "x" * 60_000 + "\n"})
    kept = sum(bounds.event_weight(e) for e in stream.events if e["kind"] == "output")
    assert kept <= 1 << 20 and stream.dropped > 150
    assert max(len(line) for _, line in stream.state.workers[0].output) < bounds.LINE_CHARS + 50
    stream.close()  # the run has ended: less is kept
    assert sum(bounds.event_weight(e) for e in stream.events if e["kind"] == "output") <= bounds.ENDED_TAIL_BYTES


@pytest.mark.unit
def test_the_log_stops_taking_progress_at_its_limit_and_says_so_once(monkeypatch, tmp_path):
    monkeypatch.setattr(bounds, "LOG_BYTES", 20_000)
    log = open(tmp_path / "events.jsonl", "a", buffering=1)
    stream = EventStream(log)
    stream.emit(_started())
    for step in range(1, 1001):
        stream.emit({"kind": "progress", "time": float(step), "rank": 0, "step": step, "metrics": {"loss": 0.1}})
    stream.emit({"kind": "run_finished", "time": 2000.0, "status": "succeeded"})
    log.close()
    written = [json.loads(line) for line in open(tmp_path / "events.jsonl")]
    assert (tmp_path / "events.jsonl").stat().st_size < 20_000 + 200
    assert [e["kind"] for e in written].count("log_truncated") == 1
    assert written[-1]["kind"] == "run_finished"  # lifecycle events are still written
    assert stream.state.log_truncated and stream.state.workers[0].step == 1000


@pytest.mark.processes
def test_a_run_printing_without_end_keeps_a_bounded_tail_and_the_rest_on_disk(monkeypatch):
    monkeypatch.setattr(bounds, "TAIL_BYTES", 256 * 1024)
    monkeypatch.setattr(bounds, "LOG_BYTES", 3 * 2**20)
    run = ddp_notebook.launch(faults.prints_and_logs, devices="cpu:0", kwargs=dict(mb=4, metric_chars=10**6))
    with pytest.raises(ddp_notebook.WorkerFailedError) as e:
        run.wait(timeout=120)
    kept = sum(bounds.event_weight(e) for e in run.events if e["kind"] in ("output", "progress"))
    assert kept <= 256 * 1024 and run.stream.dropped > 0
    text = run.output(0, "stdout")
    assert text.startswith("line 0 ") and "reached its limit of 3 MB" in text and "line 65535 " in text
    assert 2 * 2**20 < len(text) < 4 * 2**20
    assert all(len(v) < bounds.METRIC_CHARS + 100 for w in run.workers for v in w.metrics.values()
               if isinstance(v, str))
    message = e.value.failure.message
    assert message.startswith("big ") and message.endswith(" end") and len(message) < bounds.TEXT_CHARS + 100
    assert ddp_notebook.Run.load(run.run_dir).state.log_truncated


@pytest.mark.processes
def test_output_under_the_limits_comes_back_exactly_multibyte_characters_included():
    # one line of 1.3 MB: read in 64 KiB pieces, which split characters and exceed one chunk
    text = "é日本語 " * 100_000  # written at once: the reads split characters
    run = ddp_notebook.launch(faults.prints_text, devices="cpu:0", kwargs=dict(text=text, times=1))
    run.wait(timeout=120)
    assert run.output(0, "stdout") == text + "\n"


@pytest.mark.unit
def test_a_report_of_many_numbers_weighs_its_names_and_values():
    metrics = {f"grad_norm/encoder.layers.{i}.attention.weight": 0.5 for i in range(150)}
    assert bounds.event_weight({"kind": "progress", "metrics": metrics}) > 150 * 100
