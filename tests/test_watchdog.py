"""The hang watchdog with real processes and gloo: on by default, it names a frozen rank that
its peers wait for, before or after its first report, and never fails slow or quiet work.

The auto watchdog's floor is 300 s for users; these tests lower it with
``$DDP_NOTEBOOK_STALL_FLOOR`` (read at each launch in the notebook process)."""
import pytest

import ddp_notebook
from ddp_notebook import WorkerFailedError
from ddp_notebook.errors import LaunchOptionError, RunStoppedError
from ddp_notebook.lifecycle.options import LaunchOptions

import faults

pytestmark = pytest.mark.processes


@pytest.fixture
def floor(monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_STALL_FLOOR", "1.5")


def test_the_watchdog_is_on_by_default():
    assert LaunchOptions().stall_timeout == "auto"


@pytest.mark.parametrize("report_first", [False, True])
@pytest.mark.parametrize("bad_rank", [0, 1])
def test_auto_names_a_frozen_rank_its_peer_waits_for(floor, bad_rank, report_first):
    run = ddp_notebook.launch(faults.hang_on_rank, devices="cpu*2", kwargs=dict(bad_rank=bad_rank,
                                                                                report_first=report_first))
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    err = e.value
    assert (err.rank, err.failure.kind) == (bad_rank, "stall"), str(err)
    assert str(err).startswith(f"Distributed data parallel {'main worker' if bad_rank == 0 else 'worker 1'} "
                               f"(cpu:{bad_rank}) failed: stalled: no progress for ")
    assert "time.sleep(3600)" in err.failure.traceback  # the hung rank's own stack
    assert [f.rank for f in run.failures if not f.consequence] == [bad_rank]
    # The peer was ended: stopped, or failed as a knock-on when the hung rank's end reached its
    # collective before the interrupt did (either way not a cause).
    assert {w.rank: w.shown_status for w in run.workers}[1 - bad_rank] in ("stopped", "knock-on")


def test_auto_never_fails_a_rank_that_works_while_its_peer_waits(floor):
    # 5.5 s of computing on rank 0 (the floor is 1.5 s, each look 2 s: a whole look ends 2 s before
    # the work does), with rank 1 waiting in all_reduce.
    run = ddp_notebook.launch(faults.busy_outside_collective, devices="cpu*2", kwargs=dict(seconds=5.5))
    assert run.wait(timeout=120) == 2.0 and run.status == "succeeded"


def test_auto_counts_the_work_of_a_ranks_child_processes(floor):
    run = ddp_notebook.launch(faults.busy_in_a_child_process, devices="cpu*2", kwargs=dict(seconds=5.5))
    assert run.wait(timeout=120) == 0 and run.status == "succeeded"


def test_the_watchdog_never_triggers_a_users_sigusr1_handler(floor):
    run = ddp_notebook.launch(faults.own_sigusr1_handler_while_busy, devices="cpu*2", kwargs=dict(seconds=5.5))
    assert run.wait(timeout=120) == 0 and run.status == "succeeded"


def test_the_floor_is_read_only_when_the_auto_watchdog_is_used(monkeypatch):
    monkeypatch.setenv("DDP_NOTEBOOK_STALL_FLOOR", "abc")
    for setting in (None, 30.0):
        assert ddp_notebook.launch(faults.quiet_without_collective, devices="cpu*2", kwargs=dict(seconds=0.1),
                                   stall_timeout=setting).wait(timeout=120) == 0


def test_auto_never_fails_quiet_ranks_that_wait_for_no_peer(floor):
    # 5.5 s: long enough for two samples (at 1.5 s and 3.5 s) were the ranks taken as waiting.
    run = ddp_notebook.launch(faults.quiet_without_collective, devices="cpu*2", kwargs=dict(seconds=5.5))
    assert run.wait(timeout=120) == 0 and run.status == "succeeded"


def test_seconds_fail_a_hang_before_the_first_report():
    run = ddp_notebook.launch(faults.hang_on_rank, devices="cpu*2", stall_timeout=2.0)
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    assert (e.value.rank, e.value.failure.kind) == (1, "stall")


def test_off_leaves_a_hang_to_the_user():
    run = ddp_notebook.launch(faults.hang_on_rank, devices="cpu*2", stall_timeout=None)
    with pytest.raises(TimeoutError):
        run.wait(timeout=4)
    assert run.status == "running"
    run.stop(grace=0)
    with pytest.raises(RunStoppedError):
        run.wait(timeout=60)
    assert run.status == "stopped"


@pytest.mark.parametrize("value", ["", "soon", "-1", "nan", "inf"])
def test_a_bad_floor_is_said_before_anything_starts(monkeypatch, value, tmp_path):
    monkeypatch.setenv("DDP_NOTEBOOK_STALL_FLOOR", value)
    if value == "":  # unset in effect: the default floor
        assert LaunchOptions().stall_timeout == "auto"
        return
    with pytest.raises(LaunchOptionError, match=r"^\$DDP_NOTEBOOK_STALL_FLOOR must be a number of seconds > 0, "):
        ddp_notebook.launch(lambda ctx: None, devices="cpu:0", run_root=str(tmp_path))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("stall_timeout", [2.0, "auto"])
def test_a_deadlock_of_collectives_is_said_to_be_undecidable_not_blamed_on_rank_0(floor, stall_timeout):
    run = ddp_notebook.launch(faults.deadlock, devices="cpu*2", stall_timeout=stall_timeout)
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    text = str(e.value)
    assert text.startswith("Distributed data parallel workers (cpu:0, cpu:1) are deadlocked: each waits in a "
                           "collective for another, no progress for "), text
    assert "rank 0 at faults.py:" in text and "`dist.barrier()`" in text and "`dist.recv(torch.zeros(1), src=0)`" in text
    assert text.endswith("which one took the wrong turn cannot be told from their stacks")
    assert run.state.healthy_devices == [] and all(w.status in ("failed", "stopped") for w in run.workers)
    report = "\n".join(e.value._render_traceback_())
    assert "Where each worker waits:\nrank 0 (cpu:0): Stack" in report and "rank 1 (cpu:1): Stack" in report
    assert "failed as well" not in report  # said once, for both


@pytest.mark.parametrize("stall_timeout", [2.0, "auto"])
def test_the_report_names_the_last_step_even_when_the_throttle_held_it_back(floor, stall_timeout):
    run = ddp_notebook.launch(faults.hang_after_quick_steps, devices="cpu*2", stall_timeout=stall_timeout,
                              progress_interval=60.0)  # only the first report goes out on its own
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    assert e.value.rank == 1 and e.value.failure.last_step == 5, str(e.value)
    assert "(last step 5)" in str(e.value) and run.workers[1].step == 5


def test_a_rank_left_waiting_by_a_peer_that_returned_early_is_told_so(floor):
    run = ddp_notebook.launch(faults.returns_early, devices="cpu*2")
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    text = str(e.value)
    assert text.startswith("Distributed data parallel main worker (cpu:0) failed: stalled: no progress for "), text
    assert ": it waits in a collective (faults.py:" in text and "for worker 1, which returned from the function" in text
    assert "nobody" not in text and "no other worker was waiting" not in text


def test_seconds_fail_quiet_ranks_and_say_nobody_waited():
    run = ddp_notebook.launch(faults.quiet_without_collective, devices="cpu*2", kwargs=dict(seconds=3600.0),
                              stall_timeout=2.0)
    with pytest.raises(WorkerFailedError) as e:
        run.wait(timeout=120)
    assert str(e.value).endswith("(no other worker was waiting for it)"), str(e.value)
