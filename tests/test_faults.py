"""Fault injection on the main and on a secondary rank, with real processes and gloo."""
import pytest

import ddp_notebook
from ddp_notebook import WorkerFailedError
from ddp_notebook.errors import NotPicklableError

import faults
from helpers import has_ended, started_processes

pytestmark = pytest.mark.processes

RUNTIME_FAULTS = {
    "raise": ("exception", "ValueError: boom at step 3"),
    "exit": ("exit", "exited with code 3 before reporting a result"),
    "sigkill": ("signal", "killed by signal SIGKILL (often the out-of-memory killer"),
    "segfault": ("signal", "crashed with a segmentation fault (SIGSEGV)"),
    "stall": ("stall", "stalled: no progress for"),
}


def name(rank):
    return "main worker" if rank == 0 else f"worker {rank}"


def assert_peers_stopped(run, bad_rank):
    knock_on = {f.rank for f in run.failures if f.consequence}
    for w in run.workers:
        if w.rank != bad_rank:
            # a peer either was stopped, or failed first as a consequence (e.g. "Connection reset by peer")
            assert w.status == "stopped" or (w.status == "failed" and w.rank in knock_on), (w.rank, w.status)
        assert w.exit_code is not None
        assert has_ended(w.pid)


@pytest.mark.parametrize("bad_rank", [0, 1])
@pytest.mark.parametrize("fault", list(RUNTIME_FAULTS))
def test_runtime_fault(fault, bad_rank):
    kind, text = RUNTIME_FAULTS[fault]
    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu:0,cpu:1", kwargs=dict(fault=fault, bad_rank=bad_rank),
                              stall_timeout=2.0 if fault == "stall" else None)
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    err = e.value
    assert str(err).startswith(f"Distributed data parallel {name(bad_rank)} (cpu:{bad_rank}) failed: {text}")
    assert (err.rank, err.device, err.failure.kind) == (bad_rank, f"cpu:{bad_rank}", kind)
    assert not err.failure.consequence and all(f.consequence for f in err.failures if f is not err.failure)
    assert run.status == "failed"
    assert_peers_stopped(run, bad_rank)
    if fault == "raise":
        assert "raise ValueError(f\"boom at step {step}\")" in err.failure.traceback
        assert "ddp_notebook/worker/" not in err.failure.traceback
    if fault == "segfault":
        assert "Segmentation fault" in "\n".join(err.failure.stderr_tail)
    if fault == "stall":
        assert "time.sleep(3600)" in err.failure.traceback  # the straggler's own stack
        assert err.failure.last_step is not None


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_crash_during_startup(bad_rank):
    run = ddp_notebook.launch(faults.takes_arg, devices="cpu*2", args=(faults.LoadFault(bad_rank, "exit"),))
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    assert str(e.value) == (f"Distributed data parallel {name(bad_rank)} (cpu:{bad_rank}) failed: exited with code 5 "
                            "during start-up, before running the function")
    assert_peers_stopped(run, bad_rank)


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_argument_that_cannot_be_unpickled(bad_rank):
    run = ddp_notebook.launch(faults.takes_arg, devices="cpu*2", args=(faults.LoadFault(bad_rank, "raise"),))
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    assert str(e.value) == (
        f"Distributed data parallel {name(bad_rank)} (cpu:{bad_rank}) failed: the function or its arguments could "
        "not be unpickled in the worker: ModuleNotFoundError: No module named 'only_on_the_notebook_machine'")
    assert e.value.failure.kind == "unpickle"
    assert_peers_stopped(run, bad_rank)


def test_unpicklable_function_or_argument_is_refused_before_start(tmp_path):
    import threading

    lock = threading.Lock()
    before = started_processes()
    with pytest.raises(NotPicklableError) as e:
        ddp_notebook.launch(faults.takes_arg, devices="cpu*2", args=(lock,), run_root=str(tmp_path))
    assert str(e.value).startswith("argument args[0] is a _thread.lock and cannot be sent to the worker processes: "
                                   "cannot pickle '_thread.lock' object")
    with pytest.raises(NotPicklableError, match=r"^'lock', used by the function 'closure', is a _thread.lock and "
                                                 "cannot be sent to the worker processes"):
        def closure(ctx):
            return lock
        ddp_notebook.launch(closure, devices="cpu*2", run_root=str(tmp_path))
    assert started_processes() == before and list(tmp_path.iterdir()) == []


def test_a_return_value_that_cannot_be_sent_back_names_the_function_and_its_type():
    run = ddp_notebook.launch(faults.returns_the_context, devices="cpu*2")
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    f = e.value.failure
    assert f.kind == "result" and f.rank == 0 and f.from_code
    assert str(e.value).startswith("Distributed data parallel main worker (cpu:0) failed: the return value could not "
                                   "be sent back to the notebook: TypeError: returns_the_context returned "
                                   "WorkerContext, which cannot be pickled ("), str(e.value)
    assert f.traceback == "" and f.locals == {}  # only the pickler's frames: nothing of the user's
    assert all(w.exit_code is not None and has_ended(w.pid) for w in run.workers)


def test_knock_on_failure_of_a_peer_is_marked_as_consequence():
    run = ddp_notebook.launch(faults.ignore_term_then_allreduce, devices="cpu*2", kill_grace=10.0)
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    assert e.value.rank == 1 and e.value.failure.signal == "SIGKILL"
    peer = [f for f in e.value.failures if f.rank == 0]
    assert len(peer) == 1 and peer[0].consequence and peer[0].exc_type == "RuntimeError"
    text = "\n".join(e.value._render_traceback_())
    assert "Also: main worker (cpu:0) failed as a consequence: RuntimeError:" in text
    assert text.endswith("WorkerFailedError: " + e.value.failure.headline())


def test_an_exception_whose_str_fails_is_still_reported_with_its_type_and_traceback():
    run = ddp_notebook.launch(faults.raises_unprintable, devices="cpu*2")
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    assert str(e.value).startswith("Distributed data parallel worker 1 (cpu:1) failed: UnprintableError: "
                                   "<exception str() failed>")
    assert "raise UnprintableError()" in e.value.failure.traceback


def test_a_metric_may_be_named_self_and_a_value_that_is_no_number_is_named():
    run = ddp_notebook.launch(faults.logs_odd_names, devices="cpu*2")
    assert run.wait(timeout=60) == "metric 'cplx' must be a number or a string, not complex"
    assert run.workers[0].metrics["self"] == 1.0


def test_the_stderr_tail_of_a_failure_shows_a_progress_bar_as_one_line():
    run = ddp_notebook.launch(faults.bar_then_exit, devices="cpu*2")
    with pytest.raises(WorkerFailedError, match=r"worker 1 \(cpu:1\) failed: exited with code 3"):
        run.wait(timeout=60)
    assert run.root_failure.stderr_tail[-1:] == ["load 90%"] and "load 10%" not in run.root_failure.stderr_tail


def test_function_raising_sysexit_is_a_failure():
    def leaves(ctx):
        raise SystemExit(2)

    with pytest.raises(WorkerFailedError, match=r"main worker \(cpu:0\) failed: SystemExit: 2"):
        ddp_notebook.launch(leaves, devices="cpu:0").wait(timeout=60)


def test_an_error_every_rank_raises_is_the_runs_said_once():
    run = ddp_notebook.launch(faults.same_error_everywhere, devices="cpu*2", kwargs=dict(config={"lr": 0.1}))
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=60)
    err = e.value
    assert str(err) == ("Every distributed data parallel worker (cpu:0, cpu:1) failed the same way: "
                        "KeyError: 'learning_rate'")
    assert err.failure.same_on == ["cpu:0", "cpu:1"] and not any(f.consequence for f in err.failures)
    report = "\n".join(err._render_traceback_())
    assert report.count("KeyError: 'learning_rate'") == 2  # the traceback's last line and the headline
    assert "Also:" not in report
    assert run.state.healthy_devices == []
    for w in run.workers:
        assert w.status == "failed" and w.exit_code is not None
        assert has_ended(w.pid)
