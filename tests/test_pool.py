"""The warm worker pool: runs take warm processes, each used once, refilled and resized after runs.

The pool is how workers start where there is no fork server: these tests turn the server off."""
import psutil
import pytest

import ddp_notebook
from ddp_notebook import forkserver, pool

import faults
from helpers import has_ended

pytestmark = pytest.mark.processes


@pytest.fixture(autouse=True, scope="module")
def no_fork_server():
    forkserver.disable()
    yield
    forkserver.enable()


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
    assert all(has_ended(p) for p in idle)
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
    assert all(has_ended(p.pid) for p in procs)


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


@pytest.mark.parametrize("pooled", [True, False])
def test_workers_see_the_notebooks_environment_and_directory_at_launch(pooled, monkeypatch, tmp_path):
    if pooled:
        pool.enable(2)
        ddp_notebook.launch(faults.ddp_steps, devices="cpu*2").wait(timeout=60)  # the pool is warm now
    else:
        pool.disable()
    try:
        monkeypatch.setenv("DDP_NB_SET_LATER", "in a later cell")
        monkeypatch.delenv("DDP_NB_REMOVED_LATER", raising=False)
        monkeypatch.chdir(tmp_path)
        idle = pool.get_pool().idle_pids()
        run = ddp_notebook.launch(faults.environment, devices="cpu*2",
                                  args=(("DDP_NB_SET_LATER", "DDP_NB_REMOVED_LATER"),))
        seen, cwd = run.wait(timeout=60)
        assert seen == {"DDP_NB_SET_LATER": "in a later cell", "DDP_NB_REMOVED_LATER": None}
        assert cwd == str(tmp_path)
        if pooled:  # started before the notebook changed: the same processes ran it
            assert sorted(w.pid for w in run.workers) == sorted(idle)
    finally:
        pool.disable()


@pytest.fixture(autouse=True, scope="module")
def _a_variable_the_pool_starts_with():
    import os

    os.environ["DDP_NB_REMOVED_LATER"] = "set when the pool started"
    yield
    os.environ.pop("DDP_NB_REMOVED_LATER", None)
