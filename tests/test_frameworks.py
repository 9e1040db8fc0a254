"""Lightning (Trainer, Fabric), accelerate and Hugging Face Trainer code, unchanged, in
ddp_notebook's workers: it joins the run's process group, its progress shows live, a failure
names its rank, and a retry on one device trains on one."""
import pytest
import torch

import ddp_notebook
from ddp_notebook import WorkerFailedError

import framework_code
from helpers import wait_for

pytestmark = [pytest.mark.processes, pytest.mark.frameworks]

NEEDS = {"lightning": "lightning", "fabric": "lightning", "accelerate": "accelerate", "transformers": "transformers"}


def progress_of(run, rank):
    return [e for e in run.events if e.get("kind") == "progress" and e.get("rank") == rank]


@pytest.mark.parametrize("framework", sorted(NEEDS))
def test_unchanged_framework_code_trains_shows_progress_names_the_failed_rank_and_retries(framework):
    pytest.importorskip(NEEDS[framework])
    fn = getattr(framework_code, framework)
    run = ddp_notebook.launch(fn, devices="cpu*2")
    result = run.wait(timeout=300)
    assert result["world_size"] == 2 and result["same_on_every_rank"]
    if "model" in result:  # a LightningModule, a Hugging Face model: back in the notebook as itself
        flat = torch.cat([p.detach().reshape(-1) for p in result["model"].parameters()])
        assert torch.equal(flat, result["weights"])
    for rank in (0, 1):  # its steps and loss reached the run's state while it trained
        progress = progress_of(run, rank)
        assert any(e.get("step", 0) >= 1 and any("loss" in name for name in e["metrics"]) for e in progress), progress
    if framework in ("lightning", "transformers"):  # a loop that knows its length says it
        assert [(w.step, w.total) for w in run.workers] == [(run.workers[0].total,) * 2] * 2

    failing = ddp_notebook.launch(fn, devices="cpu*2", kwargs={"fail_rank": 1})
    with pytest.raises(WorkerFailedError) as failed:
        failing.wait(timeout=300)
    assert str(failed.value).startswith(f"Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom in "
                                        f"{framework}")
    single = failing.retry()  # code written for devices=2 runs on the one device of the retry
    assert single.wait(timeout=300)["world_size"] == 1 and single.status == "succeeded"


@pytest.mark.parametrize("framework", ["lightning", "transformers"])
def test_a_stopped_trainer_leaves_its_loop_on_every_rank_at_once_and_is_stopped_not_failed(framework):
    pytest.importorskip(NEEDS[framework])
    long = {"epochs": 1000} if framework == "lightning" else {"steps": 10_000}
    run = ddp_notebook.launch(getattr(framework_code, framework), devices="cpu*2", kwargs=dict(long, pause=0.01))
    wait_for(run, lambda state: all((w.step or 0) >= 3 for w in state.workers.values()), timeout=300)
    run.stop(wait=True)  # the default grace is 10 s: a cooperative stop needs none of it
    assert run.status == "stopped" and not run.failures, run.failures
    assert not any(e.get("kind") == "exited" and e.get("by_supervisor") for e in run.events)  # none was forced
    steps = {w.step for w in run.workers}
    assert len(steps) == 1, steps  # the same step on both ranks


def test_a_process_that_turns_the_stops_sigterm_into_an_exception_is_stopped_not_failed():
    run = ddp_notebook.launch(framework_code.ignores_stop_and_raises_on_sigterm, devices="cpu*2")
    wait_for(run, lambda state: all((w.step or 0) >= 3 for w in state.workers.values()), timeout=300)
    run.stop(grace=0.5, wait=True)
    assert run.status == "stopped" and not run.failures, run.failures
    assert [w.status for w in run.workers] == ["stopped", "stopped"]


def test_the_last_loss_and_epoch_of_a_fast_lightning_fit_are_shown_not_a_stale_one():
    pytest.importorskip("lightning")
    # (a metric the module logs under a name of ctx.log's own parameters is shown as any other)
    run = ddp_notebook.launch(framework_code.lightning, devices="cpu*2", kwargs={"epochs": 6, "also_log": "self"})
    run.wait(timeout=300)
    assert run.workers[0].metrics["self"] == 1.0
    for rank in (0, 1):
        last = [e for e in progress_of(run, rank) if "loss" in e["metrics"]][-1]
        assert last["step"] == run.workers[rank].total  # the loss of the last step, not of a step before it
    assert [w.epoch_text for w in run.workers] == ["epoch 6/6", "epoch 6/6"]
    for w in run.workers:  # the plot has every step's loss, from the first (read at no cost on a CPU)
        steps = [step for step, _ in w.loss_history]
        assert steps[0] == 1 and steps == sorted(steps) and len(steps) == w.total, steps


def test_lightning_code_written_for_its_own_notebook_strategy_runs_as_it_is():
    pytest.importorskip("lightning")
    result = ddp_notebook.launch(framework_code.lightning, devices="cpu*2", kwargs={"strategy": "ddp_notebook"})
    assert result.wait(timeout=300)["world_size"] == 2
    # Two nodes of one device each, on one host: the run's ranks, as Lightning counts them per node.
    nodes = ddp_notebook.launch(framework_code.lightning, devices="cpu*2", kwargs={"devices": 1, "num_nodes": 2})
    assert nodes.wait(timeout=300)["same_on_every_rank"] and "num_nodes=2 runs on this run's 2" in nodes.output(1)


def test_accelerates_own_notebook_launcher_inside_a_launched_function_runs_on_its_rank():
    pytest.importorskip("accelerate")
    assert ddp_notebook.launch(framework_code.accelerate_launcher_inside, devices="cpu*2").wait(timeout=300) == (2, 6.0)


def test_framework_progress_can_be_turned_off():
    pytest.importorskip("accelerate")
    run = ddp_notebook.launch(framework_code.accelerate, devices="cpu*2",
                              env={"DDP_NOTEBOOK_FRAMEWORK_PROGRESS": "0"})
    assert run.wait(timeout=300)["same_on_every_rank"]
    assert progress_of(run, 0) == progress_of(run, 1) == []


def test_accelerates_own_notebook_tests_pass_through_the_drop_in(monkeypatch):
    # accelerate's test_utils/scripts/test_notebook.py, its launcher replaced by the drop-in, on 2
    # processes: the fault-tolerant test drains its queue through max_restarts.
    pytest.importorskip("accelerate")
    import time

    from accelerate.test_utils.scripts import test_notebook as theirs

    from ddp_notebook.integrations.accelerate import notebook_launcher

    monkeypatch.setattr(theirs, "notebook_launcher", notebook_launcher)
    monkeypatch.setattr(theirs, "NUM_PROCESSES", 2)
    for name in ("test_can_initialize", "test_clean_cuda_fork", "test_mixed_precision", "test_static_rdzv_backend",
                 "test_c10d_rdzv_backend"):
        getattr(theirs, name)()
    # Its fault-tolerant function on one process: with two, both take from the queue, and once it
    # holds 0 one rank may find it empty after empty() said it was not, and wait in get() for an
    # item no one puts (as it would under accelerate's own launcher). One rank drains it in 3 restarts.
    monkeypatch.setattr(theirs, "NUM_PROCESSES", 1)
    theirs.test_fault_tolerant()
    assert [r.status for r in _attempts(ddp_notebook.last_run())] == ["failed"] * 3 + ["succeeded"]
    # test_monitoring: a rank that raises ends the one that sleeps at once (accelerate's expects
    # torch elastic's ChildFailedError; the drop-in raises WorkerFailedError, torch's spawn type).
    started = time.monotonic()
    with pytest.raises(WorkerFailedError, match="I'm an even process. I don't like to sleep."):
        notebook_launcher(theirs.bipolar_sleep_function, (100,), num_processes=2, monitor_interval=0.01)
    assert time.monotonic() - started < 60


def _attempts(run):
    chain = [run]
    while chain[-1].parent is not None:
        chain.append(chain[-1].parent)
    return chain[::-1]


def test_accelerate_notebook_launcher_drop_in():
    pytest.importorskip("accelerate")
    from ddp_notebook.integrations.accelerate import notebook_launcher

    assert notebook_launcher(framework_code.accelerate_launched, args=(3,), num_processes=2) == (2, 6.0)
    with pytest.raises(WorkerFailedError, match="worker 1 \\(cpu:1\\) failed: ValueError: boom in notebook_launcher"):
        notebook_launcher(framework_code.accelerate_launched, args=(3, 1), num_processes=2)
    assert ddp_notebook.last_run().retry().wait(timeout=300) == (1, 3.0)
    with pytest.raises(ddp_notebook.errors.LaunchOptionError, match="num_nodes=1 and node_rank=0"):
        notebook_launcher(framework_code.accelerate_launched, args=(3,), num_processes=2, num_nodes=2)
