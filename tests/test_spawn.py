"""Existing DDP code (tutorial style, its own init_process_group) under ddp_notebook.spawn."""
import pytest

import ddp_notebook
from ddp_notebook import WorkerFailedError

import tutorial_ddp

pytestmark = pytest.mark.processes


def test_tutorial_function_runs_unchanged_on_two_workers():
    run = ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, join=False)
    rank, world, _ = run.wait(timeout=60)
    assert (rank, world) == (0, 2) and run.status == "succeeded"
    assert run.output(1) == "Running basic DDP example on rank 1.\n"


def test_code_that_sets_its_own_master_port_meets_there():
    import socket

    with socket.socket() as s:  # a free port, for this test only
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert ddp_notebook.spawn(tutorial_ddp.hardcoded_port, args=(2, port), nprocs=2, timeout=60) == 2.0


def test_tutorial_failure_on_rank_1_is_reported_like_any_other():
    with pytest.raises(WorkerFailedError) as e:
        ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2, 1), nprocs=2)
    assert str(e.value) == "Distributed data parallel worker 1 (cpu:1) failed: ValueError: bad batch on rank 1"
    assert 'raise ValueError(f"bad batch on rank {rank}")' in e.value.failure.traceback


def test_spawned_code_can_report_progress_and_nprocs_must_match():
    def loop(rank, steps):
        ctx = ddp_notebook.current_context()
        for step in range(1, steps + 1):
            ctx.log(step=step, total=steps)
        return ctx.world_size

    run = ddp_notebook.spawn(loop, args=(3,), devices="cpu:0,cpu:1", join=False)
    assert run.wait(timeout=60) == 2 and [w.step for w in run.workers] == [3, 3]
    with pytest.raises(ValueError, match="nprocs=3 does not match the 2 devices"):
        ddp_notebook.spawn(loop, args=(3,), nprocs=3, devices="cpu*2")


def test_tutorial_teardown_on_warm_workers_does_not_hang():
    # destroy_process_group() and then dropping the DDP model deadlocked in torch's gloo
    # teardown about one run in seven on warm workers (ddp_notebook._teardown defers it).
    ddp_notebook.pool.enable(2)
    try:
        for _ in range(6):
            assert ddp_notebook.pool.get_pool().wait_warm()
            run = ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, join=False)
            assert run.wait(timeout=60)[:2] == (0, 2)
    finally:
        ddp_notebook.pool.disable()
