"""Existing DDP code (tutorial style, its own init_process_group) under ddp_notebook.spawn."""
import pytest
import torch

import ddp_notebook
from ddp_notebook import WorkerFailedError

import tutorial_ddp
from helpers import wait_until

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
    # teardown about one run in seven on warm workers (worker.teardown defers it); forked
    # workers are warm ones: torch and what DDP imports on first use are in them already.
    for _ in range(6):
        run = ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, join=False)
        assert run.wait(timeout=60)[:2] == (0, 2)


@pytest.mark.parametrize("start_method", ["spawn", "fork", "forkserver"])
def test_torch_spawn_keywords_are_taken(start_method):
    # daemon= and start_method= change nothing here: workers never outlive the notebook, and
    # every one starts from the CUDA-free fork server.
    assert ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, daemon=True,
                              start_method=start_method)[:2] == (0, 2)


def test_bad_torch_spawn_keywords_are_refused_by_name():
    with pytest.raises(ddp_notebook.errors.LaunchOptionError, match="start_method must be one of 'spawn', 'fork', "
                       "'forkserver'.*not 'threads'"):
        ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, start_method="threads")
    with pytest.raises(ddp_notebook.errors.LaunchOptionError, match="daemon"):
        ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, daemon="yes")


@pytest.mark.parametrize("kind", ["SimpleQueue", "Queue"])
def test_items_put_in_a_multiprocessing_queue_reach_the_notebook(kind):
    import torch.multiprocessing as mp

    queue = getattr(mp, kind)()  # (a "spawn" context's queue would start multiprocessing's resource tracker)
    nbytes = 4 * 2**20  # more than a pipe holds: the notebook's put must not block the run
    ddp_notebook.spawn(tutorial_ddp.puts_in_queue, args=(queue, nbytes), nprocs=2)
    items = [queue.get() for _ in range(4)]
    tensors = sorted((i for i in items if isinstance(i, tuple)), key=lambda item: item[0])
    assert [(rank, t.numel(), float(t.sum())) for rank, t in tensors] == [(0, nbytes // 4, 0.0),
                                                                          (1, nbytes // 4, nbytes // 4)]
    assert sorted(i for i in items if isinstance(i, str)) == ["rank 0 done", "rank 1 done"]
    for rank in (0, 1):  # each rank's items come in the order it put them
        assert items.index(tensors[rank]) < items.index(f"rank {rank} done")


def test_a_queue_of_the_call_works_both_ways_on_the_ranks_as_an_inherited_one_does():
    import torch.multiprocessing as mp

    q = mp.Queue()
    for item in ("a", "b", torch.ones(3)):
        q.put(item)
    # Each rank takes one item, says what it saw, and puts its rank back: get, empty, qsize, put.
    got = ddp_notebook.spawn(tutorial_ddp.gets_from_queue, args=(q,), nprocs=2, join=False).wait(timeout=60)
    assert got[0] in ("a", "b") and got[1] >= 0 and got[2] is False
    rest = sorted(str(q.get(timeout=10)) for _ in range(3))  # one item left, and each rank's number
    assert rest[:2] == ["0", "1"] and rest[2] in ("a", "b", "tensor([1., 1., 1.])"), rest
    assert q.empty()
    # A get that finds nothing raises queue.Empty on the rank, at once or after its timeout.
    assert ddp_notebook.spawn(tutorial_ddp.gets_from_queue, args=(mp.SimpleQueue(), 0.2), nprocs=1,
                              join=False).wait(timeout=60) == "empty"


def test_accelerate_s_fault_tolerant_function_drains_its_queue_through_restarts():
    # accelerate's test_notebook.py: each failed run puts one less back, until a run succeeds.
    import torch.multiprocessing as mp

    from ddp_notebook.integrations.accelerate import notebook_launcher

    q = mp.Queue()
    q.put(3)  # (one process: with two, both take from the queue, and one may wait for an item no one puts)
    notebook_launcher(tutorial_ddp.tough_nut_function, (q,), num_processes=1, max_restarts=3)
    assert q.empty()
    run = ddp_notebook.last_run()
    assert run.status == "succeeded" and run.parent.parent.parent.status == "failed"  # three restarts


def test_join_false_gives_what_process_context_callers_use():
    run = ddp_notebook.spawn(tutorial_ddp.waits_for_stop, args=(2,), nprocs=2, join=False)
    assert all(p.pid and p.is_alive() for p in run.processes)  # started when spawn returns, as torch's are
    assert run.join(timeout=0.05) is False
    assert run.pids() == [w.pid for w in run.workers] and [p.exitcode for p in run.processes] == [None, None]
    run.processes[1].terminate()  # one rank cannot go on alone: the run is stopped
    with pytest.raises(ddp_notebook.errors.RunStoppedError):
        run.join()
    assert [p.is_alive() for p in run.processes] == [False, False]
    assert all(p.exitcode is not None for p in run.processes)
    failing = ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2, 1), nprocs=2, join=False)
    with pytest.raises(WorkerFailedError, match="worker 1"):
        while not failing.join(timeout=0.5):
            pass
    assert ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2, join=False).join() is True


def test_a_failure_is_also_the_exception_torch_multiprocessing_spawn_raises():
    import pickle

    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    with pytest.raises(ProcessRaisedException) as raised:
        ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2, 1), nprocs=2)
    assert isinstance(raised.value, WorkerFailedError) and raised.value.error_index == 1
    assert raised.value.error_pid == raised.value.failure.pid and "worker 1 (cpu:1)" in raised.value.msg
    assert type(pickle.loads(pickle.dumps(raised.value))) is WorkerFailedError
    with pytest.raises(ProcessExitedException) as exited:
        ddp_notebook.spawn(tutorial_ddp.exits_on, args=(1, 3), nprocs=2)
    assert (exited.value.error_index, exited.value.exit_code, exited.value.signal_name) == (1, 3, None)
    run = ddp_notebook.spawn(tutorial_ddp.exits_on, args=(1, 3), nprocs=2, join=False)
    with pytest.raises(ProcessExitedException):
        run.join()


def test_a_managers_dict_among_the_arguments_collects_what_the_workers_put_in_it():
    import multiprocessing

    with multiprocessing.Manager() as manager:  # the usual way to collect results from mp.spawn
        results = manager.dict()
        ddp_notebook.spawn(tutorial_ddp.stores_result, args=(results,), nprocs=2)
        assert dict(results) == {0: 0, 1: 10}


def test_nprocs_defaults_to_one_as_torchs_does():
    assert ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(1,)) == (0, 1, pytest.approx(0.0, abs=1e9))


def test_what_workers_print_is_printed_in_the_notebook_as_it_comes(capsys):
    ddp_notebook.spawn(tutorial_ddp.demo_basic, args=(2,), nprocs=2)
    out = capsys.readouterr().out
    assert "[rank0]:Running basic DDP example on rank 0.\n" in out
    assert "[rank1]:Running basic DDP example on rank 1.\n" in out


def test_an_interrupt_ends_the_workers_and_the_tutorial_runs_again_on_its_fixed_port():
    import os
    import signal
    import socket
    import threading

    with socket.socket() as s:  # a free port, for this test only
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # Ctrl-C as Python has it (a test before may have left SIGINT ignored or handled elsewhere).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for _ in range(3):
            before = ddp_notebook.last_run()

            def interrupt_once_up(before=before):
                wait_until(lambda: ddp_notebook.last_run() is not before
                           and [w.step for w in ddp_notebook.last_run().workers] == [1, 1])
                os.kill(os.getpid(), signal.SIGINT)

            threading.Thread(target=interrupt_once_up, daemon=True).start()
            with pytest.raises(KeyboardInterrupt):
                ddp_notebook.spawn(tutorial_ddp.blocks_on_port, args=(2, port), nprocs=2)
            run = ddp_notebook.last_run()
            assert run.status == "stopped" and not any(p.is_alive() for p in run.processes)
            assert ddp_notebook.spawn(tutorial_ddp.hardcoded_port, args=(2, port), nprocs=2) == 2.0
    finally:
        signal.signal(signal.SIGINT, previous)
