"""A function's own init_process_group: torchrun-style code joins the run's group under launch;
a call that could never meet (another world size, rank or backend) is refused at once."""
import time

import pytest
import torch.distributed as dist

import ddp_notebook
from ddp_notebook import WorkerFailedError
from ddp_notebook.errors import ProcessGroupMismatchError

import tutorial_ddp

pytestmark = pytest.mark.processes


def test_torchrun_style_code_joins_the_runs_group_under_launch():
    # It calls init_process_group() with nothing but the environment, as under torchrun.
    run = ddp_notebook.launch(lambda ctx: (tutorial_ddp.torchrun_main(), dist.is_initialized()), devices="cpu*2")
    (rank, world_size, weights), still_initialized = run.wait(timeout=120)
    assert (rank, world_size) == (0, 2)
    assert not still_initialized  # its destroy_process_group() ended what it asked for, as under torchrun
    # The same weights on both ranks: they trained in one group (rank 1's sum is in its output).
    # (a backend string that names the run's backend among others is the run's group too)
    again = ddp_notebook.launch(lambda ctx: tutorial_ddp.torchrun_main(backend="cpu:gloo,cuda:nccl")[2],
                                devices="cpu*2").wait(timeout=120)
    assert again == pytest.approx(weights)


def test_a_spawn_function_asking_for_more_ranks_than_the_run_has_is_refused_at_once():
    t0 = time.monotonic()
    with pytest.raises(WorkerFailedError) as e:
        ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=1)
    assert time.monotonic() - t0 < 60  # not the rendezvous timeout (30 min)
    assert e.value.failure.exc_type == ProcessGroupMismatchError.__name__
    assert str(e.value).startswith("Distributed data parallel main worker (cpu:0) failed: ProcessGroupMismatchError: "
                                   "init_process_group(world_size=2), but this run has 1 worker: it would wait")


def test_retrying_a_tutorial_failure_on_one_device_is_refused_not_hung():
    # The failure card offers a retry on the failed rank's device alone; the tutorial's world
    # size comes from args=(2,) and stays 2.
    with pytest.raises(WorkerFailedError):
        ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2, 1), nprocs=2)
    failed = ddp_notebook.last_run()
    with pytest.raises(WorkerFailedError, match=r"\(cpu:1\) failed: ProcessGroupMismatchError: "
                                                r"init_process_group\(world_size=2\), but this run has 1 worker"):
        failed.retry(devices=["cpu:1"]).wait(timeout=120)


def test_a_call_for_another_backend_or_rank_names_what_the_run_has():
    with pytest.raises(WorkerFailedError, match=r"^Every distributed data parallel worker \(cpu:0, cpu:1\) failed "
                                                r"the same way: ProcessGroupMismatchError: init_process_group\("
                                                r"backend='nccl'\), but the run's process group, set up by launch, "
                                                r"uses 'gloo'; pass backend='nccl' to launch"):
        ddp_notebook.launch(lambda ctx: tutorial_ddp.torchrun_main(backend="nccl"), devices="cpu*2").wait(timeout=120)
    with pytest.raises(WorkerFailedError, match=r"worker 1 \(cpu:1\) failed: ProcessGroupMismatchError: "
                                                r"init_process_group\(rank=0\) on the worker of rank 1"):
        ddp_notebook.spawn(lambda rank: dist.init_process_group("gloo", rank=0, world_size=2), nprocs=2)
