import pytest

import ddp_notebook
from ddp_notebook.core.failures import WorkerFailure, render_failure_report

# No module-wide mark: one test starts processes; conftest.py marks the others unit.


def failure(**kw):
    base = dict(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="ValueError", message="boom at step 5")
    base.update(kw)
    return WorkerFailure(**base)


def test_headline_secondary_and_main():
    assert failure().headline() == "Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom at step 5"
    assert failure(rank=0, device="cuda:0").headline() == \
        "Distributed data parallel main worker (cuda:0) failed: ValueError: boom at step 5"


@pytest.mark.parametrize("kw, text", [
    (dict(kind="signal", signal="SIGKILL", exc_type=None, message=""), "killed by signal SIGKILL (often the out-of-memory killer"),
    (dict(kind="signal", signal="SIGSEGV", exc_type=None, message=""), "crashed with a segmentation fault (SIGSEGV)"),
    (dict(kind="signal", signal="SIGBUS", exc_type=None, message=""), "killed by signal SIGBUS"),
    (dict(kind="exit", exit_code=3, exc_type=None, message=""), "exited with code 3 before reporting a result"),
    (dict(kind="exit", exit_code=1, phase="startup", exc_type=None, message=""), "exited with code 1 during start-up, before running the function"),
    (dict(kind="unpickle", exc_type="AttributeError", message="no attr"), "could not be unpickled in the worker: AttributeError: no attr"),
    (dict(kind="stall", stalled_for=12.0, last_step=7, exc_type=None, message=""), "stalled: no progress for 12.0 s (last step 7)"),
])
def test_summaries(kw, text):
    assert text in failure(**kw).summary()


def test_report_puts_traceback_first_and_headline_last():
    root = failure(traceback="Traceback (most recent call last):\n  File \"cell\", line 3, in train\nValueError: boom at step 5\n")
    peer = failure(rank=0, device="cpu:0", exc_type="RuntimeError", message="Connection reset by peer", consequence=True)
    text = render_failure_report(root, [root, peer])
    assert text.index("Traceback from worker 1 (cpu:1)") < text.index("in train")
    assert "Also: main worker (cpu:0) failed as a consequence: RuntimeError: Connection reset by peer" in text
    assert text.rstrip().endswith("WorkerFailedError: " + root.headline())


def test_round_trip():
    f = failure(stderr_tail=["a"])
    assert WorkerFailure.from_dict(f.to_dict()) == f


@pytest.mark.processes
def test_a_result_the_notebook_cannot_load_is_the_runs_failure(tmp_path):
    import faults

    run = ddp_notebook.launch(faults.returns_a_class_only_the_workers_have, devices="cpu*2",
                              args=(str(tmp_path),))
    with pytest.raises(ddp_notebook.WorkerFailedError) as e:
        run.wait(timeout=120)
    assert str(e.value) == ("Distributed data parallel main worker (cpu:0) failed: the return value could not be "
                            "sent back to the notebook: ModuleNotFoundError: No module named 'only_in_workers_0'")
    assert run.status == "failed" and run.workers[0].status == "failed"


def test_a_failure_the_worker_called_a_knock_on_is_never_the_cause_even_when_first():
    from ddp_notebook.core.failures import order_failures

    ended = WorkerFailure(rank=0, device="cpu:0", kind="init", time=1.0, exc_type="RunEndedError",
                          message="the run ended before every rank got this far", knock_on=True)
    cause = WorkerFailure(rank=1, device="cpu:1", kind="unpickle", time=2.0, exc_type="ModuleNotFoundError")
    root, rest = order_failures([ended, cause], world_size=2)
    assert root is cause and rest is ended and ended.consequence
