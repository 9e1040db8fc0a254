"""The warm worker pool: runs take warm processes, each used once, refilled and resized after runs."""
import psutil
import pytest

import ddp_notebook
from ddp_notebook import pool

import faults

pytestmark = pytest.mark.processes


@pytest.fixture
def warm_pool():
    pool.enable(2)
    yield pool.get_pool()
    pool.disable()


def test_runs_take_warm_workers_and_the_pool_refills(warm_pool):
    idle = warm_pool.idle_pids()
    assert len(idle) == 2 and pool.status() == {"enabled": True, "size": 2, "idle": 2}
    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu*2")
    assert run.wait(timeout=60) == [32.0, 32.0]
    assert sorted(w.pid for w in run.workers) == sorted(idle)  # the warm ones ran it
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in idle)
    refilled = warm_pool.idle_pids()
    assert len(refilled) == 2 and not set(refilled) & set(idle)  # fresh processes: nothing of a run survives


def test_failed_run_workers_are_replaced_and_pool_resizes(warm_pool):
    run = ddp_notebook.launch(faults.ddp_steps, devices="cpu*3", kwargs={"fault": "raise", "bad_rank": 2})
    with pytest.raises(ddp_notebook.WorkerFailedError, match=r"worker 2 \(cpu:2\) failed"):
        run.wait(timeout=60)
    used = {w.pid for w in run.workers}
    assert len(warm_pool.idle_pids()) == 3 and not used & set(warm_pool.idle_pids())


def test_disable_ends_idle_workers():
    pool.enable(2)
    procs = [psutil.Process(p) for p in pool.get_pool().idle_pids()]
    pool.disable()
    assert pool.status()["idle"] == 0
    assert all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in procs)


@pytest.mark.kernel
def test_load_ext_warms_the_pool_for_the_default_devices(ipython_shell):
    ddp_notebook.set_default_devices("cpu*3")
    try:
        ipython_shell.run_line_magic("load_ext", "ddp_notebook")
        ipython_shell.run_line_magic("reload_ext", "ddp_notebook")
        assert pool.status() == {"enabled": True, "size": 3, "idle": 3}
    finally:
        ddp_notebook.set_default_devices(None)
        pool.disable()
