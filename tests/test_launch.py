"""Real 2-rank runs on CPU with gloo: results, progress, output, stop, retry, on-disk log."""
import json
import os

import pytest

import ddp_notebook
from ddp_notebook import WorkerFailedError
from ddp_notebook.errors import NoResultError, RunStoppedError, WaitTimeoutError
from ddp_notebook.lifecycle import resume

import faults
from helpers import wait_for

pytestmark = pytest.mark.processes

SCALE = 3.0  # a global read by a function sent by value


def test_success_returns_main_result_and_tracks_every_rank():
    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu:0,cpu:1", kwargs={"steps": 4})
    assert run.status in ("starting", "running")
    assert run.wait(timeout=60) == [16.0, 16.0]
    assert run.status == "succeeded" and run.failures == [] and run.result() == [16.0, 16.0]
    for w in run.workers:
        assert (w.status, w.step, w.total, w.exit_code) == ("succeeded", 4, 4, 0)
        assert w.metrics["loss"] == 0.25 and w.pid
    assert [w.device for w in run.workers] == ["cpu:0", "cpu:1"] and run.workers[0].is_main


def test_closures_lambdas_and_globals_reach_the_workers():
    offset = 10

    def train(ctx, x, *, y):
        return (x + y) * SCALE + offset + ctx.rank

    assert ddp_notebook.launch(train, devices="cpu*2", args=(1,), kwargs={"y": 2}).wait(timeout=60) == 19.0
    assert ddp_notebook.launch(lambda ctx: (ctx.rank, ctx.world_size, ctx.is_main, str(ctx.device)),
                               devices="cpu:0").wait(timeout=60) == (0, 1, True, "cpu")


def test_output_is_attributed_to_its_rank_and_log_kept_on_disk():
    def talk(ctx):
        import sys

        print(f"hello from rank {ctx.rank}")
        print(f"warning on rank {ctx.rank}", file=sys.stderr)

    run = ddp_notebook.launch(talk, devices="cpu*2")
    run.wait(timeout=60)
    assert run.output(0, "stdout") == "hello from rank 0\n"
    assert run.output(1, "stdout") == "hello from rank 1\n"
    assert "warning on rank 1" in run.output(1, "stderr") and "rank 0" not in run.output(1)
    with open(os.path.join(run.run_dir, "events.jsonl")) as f:
        kinds = [json.loads(line)["kind"] for line in f]
    assert kinds[0] == "run_started" and kinds[-1] == "run_finished" and kinds.count("done") == 2
    assert not os.path.exists(os.path.join(run.run_dir, "payload.pkl"))
    assert run.events[-1] == {"kind": "run_finished", "time": run.events[-1]["time"], "status": "succeeded"}


def test_cooperative_stop_returns_what_the_main_worker_returned():
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2")
    wait_for(run, lambda s: all((w.step or 0) >= 2 for w in s.workers.values()))
    with pytest.raises(NoResultError):
        run.result()
    with pytest.raises(WaitTimeoutError):
        run.wait(timeout=0.01)
    run.stop()
    assert run.wait(timeout=60).startswith("stopped at step")
    assert run.status == "stopped" and run.state.stop_reason == "stopped by the user"


def test_stop_is_forced_after_the_grace_period():
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2", kwargs={"honour": False}, stop_grace=0.5)
    wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
    run.stop(wait=True)
    assert run.status == "stopped" and [w.status for w in run.workers] == ["stopped", "stopped"]
    with pytest.raises(RunStoppedError, match="was stopped"):
        run.wait()


@pytest.mark.parametrize("bad_rank, retry_device", [(1, "cpu:0"), (0, "cpu:1")])
def test_retry_on_a_single_device(bad_rank, retry_device):
    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu:0,cpu:1",
                              kwargs={"fault": "raise", "bad_rank": bad_rank, "at_step": 2})
    with pytest.raises(WorkerFailedError):
        run.wait(timeout=60)
    assert str(run._retry_device()) == retry_device
    again = run.retry()
    assert again.parent is run and [str(d) for d in again.devices] == [retry_device]
    if bad_rank == 0:  # the fault is on rank 0, which the retry has too: it reproduces alone
        with pytest.raises(WorkerFailedError, match=r"main worker \(cpu:1\) failed: ValueError: boom at step 2"):
            again.wait(timeout=60)
    else:
        assert again.wait(timeout=60) == [1.0, 1.0]
    assert ddp_notebook.last_run() is again
    explicit = run.retry(device="cpu:5")
    assert [str(d) for d in explicit.devices] == ["cpu:5"]
    if bad_rank == 1:
        assert explicit.wait(timeout=60) == [1.0, 1.0]
    else:
        with pytest.raises(WorkerFailedError, match=r"main worker \(cpu:5\) failed"):
            explicit.wait(timeout=60)


def test_process_group_is_ready_and_threads_are_split():
    def probe(ctx):
        import torch
        import torch.distributed as dist

        return dist.is_initialized(), dist.get_backend(), dist.get_world_size(), torch.get_num_threads(), \
            os.environ["CUDA_VISIBLE_DEVICES"]

    assert ddp_notebook.launch(probe, devices="cpu*2").wait(timeout=60) == (True, "gloo", 2, max(1, (os.cpu_count() or 1) // 2), "")


def test_finished_run_reloads_from_disk(monkeypatch):
    monkeypatch.setattr(resume, "KEEP_LIMIT", 10)  # this run's call is too large to be kept
    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu*2", kwargs={"steps": 3})
    monkeypatch.undo()
    run.wait(timeout=60)
    again = ddp_notebook.Run.load(run.run_dir)
    assert again.status == "succeeded" and again.result() == [8.0, 8.0]
    assert [w.step for w in again.workers] == [3, 3] and again.devices == run.devices
    with pytest.raises(ddp_notebook.DDPNotebookError, match="cannot be retried: its call .* was not kept there"):
        again.retry()
    with pytest.raises(ddp_notebook.errors.ArgumentsError, match=r"rank of a worker of run .* \(0, 1\), not 2"):
        again.output(2)
    with pytest.raises(ddp_notebook.errors.ArgumentsError, match="stream='stdout', 'stderr' or None"):
        again.output(0, "out")
    with pytest.raises(ddp_notebook.errors.ArgumentsError, match="callback"):
        again.subscribe("print")
    failed = ddp_notebook.launch(faults.ddp_steps, devices="cpu*2", kwargs={"fault": "raise"})
    with pytest.raises(WorkerFailedError):
        failed.wait(timeout=60)
    loaded = ddp_notebook.Run.load(failed.run_dir)
    with pytest.raises(WorkerFailedError, match=r"worker 1 \(cpu:1\) failed: ValueError: boom at step 3"):
        loaded.wait()
    retried = loaded.retry()  # from the call kept in its directory, on the device that did not fail
    assert [str(d) for d in retried.devices] == ["cpu:0"] and retried.wait(timeout=60) == [1.0, 1.0]


def test_local_rank_counts_the_ranks_on_this_host():
    def where(ctx):
        return ctx.local_rank, ctx.local_world_size, os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"]

    run = ddp_notebook.launch(where, devices="cpu*2")
    assert run.wait(timeout=60) == (0, 2, "0", "2")


def test_a_broken_supervisor_ends_the_workers_and_says_so(monkeypatch):
    from ddp_notebook.lifecycle.supervisor import Supervisor

    def broken(self):
        if self.steps:  # once a rank has made progress
            raise RuntimeError("injected bug")

    monkeypatch.setattr(Supervisor, "_check_stall", broken)
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2")
    with pytest.raises(ddp_notebook.errors.SupervisionError, match=r"supervision of run \S+ failed \(RuntimeError: injected bug\)"):
        run.wait(timeout=60)
    assert run.status == "failed" and run.state.supervisor_error == "RuntimeError: injected bug"
    assert all(w.status == "stopped" for w in run.workers)  # ended by the supervisor as it gave up
    from ddp_notebook.ui.text import format_run

    assert "supervision of this run failed: RuntimeError: injected bug" in format_run(run.state)
    assert ddp_notebook.Run.load(run.run_dir).state.supervisor_error == "RuntimeError: injected bug"


def test_a_subscriber_that_raises_is_logged_and_the_run_goes_on(caplog):
    def bad(event):
        raise ValueError("front-end bug")

    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu*2", kwargs={"steps": 2})
    run.subscribe(bad)
    with caplog.at_level("ERROR", logger="ddp_notebook.core.stream"):
        assert run.wait(timeout=60) == [4.0, 4.0]
    assert any("a subscriber of run" in r.getMessage() and r.exc_info[0] is ValueError for r in caplog.records)


# ---- max_restarts: a failed run starts again, each attempt a run of its own -----------------------
def test_a_failed_run_starts_again_from_its_checkpoint_until_it_succeeds_and_wait_follows():
    run = ddp_notebook.launch(faults.fails_until_resumed, devices="cpu*2", kwargs={"times": 2}, max_restarts=3)
    assert run.wait(timeout=120) == 3  # the third attempt, resumed from the second's checkpoint
    attempts = [run, run.restarted, run.restarted.restarted]
    assert [a.status for a in attempts] == ["failed", "failed", "succeeded"] and attempts[2].restarted is None
    assert attempts[1].parent is run and attempts[2].parent is attempts[1]
    assert [a.options.max_restarts for a in attempts] == [3, 2, 1]
    assert attempts[1].root_failure.message == "attempt 2 fails" and attempts[1].root_failure.rank == 1


def test_restarts_run_out_and_a_stopped_run_is_not_started_again():
    run = ddp_notebook.launch(faults.fails_until_resumed, devices="cpu*2", kwargs={"times": 5}, max_restarts=1)
    with pytest.raises(WorkerFailedError, match="attempt 2 fails"):
        run.wait(timeout=120)  # the last attempt's failure
    assert run.restarted is not None and run.restarted.restarted is None
    stopped = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2", max_restarts=2)
    wait_for(stopped, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
    stopped.stop(grace=5, wait=True)
    assert stopped.status == "stopped" and stopped.restarted is None

