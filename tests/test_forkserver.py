"""The fork server: every run's workers are new processes forked from one clean, torch-importing
server; the notebook's environment reaches them; its death, or its failure to start, costs no run
more than it must, and leaves nothing behind."""
import os
import resource
import signal
import sys
import textwrap
import time

import psutil
import pytest

import ddp_notebook
from ddp_notebook.executors.local import forked, forkserver
from ddp_notebook.ui.text import format_run

import faults
from helpers import has_ended, wait_for, wait_until

pytestmark = [pytest.mark.processes,
              pytest.mark.skipif(not forkserver.supported(), reason="the fork server is Linux's")]


@pytest.fixture(autouse=True)
def installed_packages_stay(monkeypatch, tmp_path_factory):
    """The installed packages as these tests see them: a site-packages folder another process of the
    suite changes meanwhile would rightly make the next launch start a new server, where these tests
    check that the same one forks."""
    folder = str(tmp_path_factory.getbasetemp() / "site-packages")
    monkeypatch.setattr(forked, "_site_dirs", lambda: [folder])


def _server() -> psutil.Process:
    forkserver.start()
    wait_until(lambda: forkserver.status()["ready"], timeout=120)
    return psutil.Process(forkserver.status()["pid"])


def worker_facts(ctx):
    import numpy as np
    import torch

    with open("/proc/self/comm") as f:
        name = f.read().strip()
    import resource
    import tempfile
    import time

    mask = os.umask(0)
    os.umask(mask)
    return {"pid": os.getpid(), "parent": os.getppid(), "group": os.getpgid(0), "name": name,
            "numpy": float(np.random.rand()), "torch": float(torch.rand(1)), "cuda": torch.cuda.is_initialized(),
            "path": list(sys.path), "rank": ctx.rank, "umask": mask, "tz": time.tzname[0],
            "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0], "tmp": tempfile.gettempdir()}


def facts_of_every_rank(ctx):
    import torch.distributed as dist

    facts = [None] * ctx.world_size
    dist.all_gather_object(facts, worker_facts(ctx))
    return facts


def test_every_run_gets_new_processes_forked_by_one_server():
    server = _server()
    first = ddp_notebook.launch(facts_of_every_rank, devices="cpu*2").wait(timeout=60)
    second = ddp_notebook.launch(facts_of_every_rank, devices="cpu*2").wait(timeout=60)
    pids = [f["pid"] for f in first + second]
    assert len(set(pids)) == 4, pids  # nothing of a run reaches the next
    for f in first + second:
        assert f["parent"] == server.pid and f["group"] == f["pid"] and f["name"] == "ddp-worker", f
        assert f["cuda"] is False
    # A fresh interpreter draws its own torch and NumPy numbers; forked ones must too (per rank, per run).
    assert len({f["numpy"] for f in first + second}) == 4 and len({f["torch"] for f in first + second}) == 4
    assert forkserver.status()["pid"] == server.pid and server.is_running()
    assert server.name() == "ddp-forkserver" and forkserver.status()["threads"] is not None


def test_the_notebooks_environment_directory_and_path_at_launch_reach_forked_workers(monkeypatch, tmp_path):
    server = _server()
    monkeypatch.setenv("DDP_NB_SET_LATER", "in a later cell")
    monkeypatch.delenv("DDP_NB_REMOVED_LATER", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path / "added_later"))
    run = ddp_notebook.launch(faults.environment, devices="cpu*2", args=(("DDP_NB_SET_LATER", "DDP_NB_REMOVED_LATER"),))
    assert run.wait(timeout=60) == ({"DDP_NB_SET_LATER": "in a later cell", "DDP_NB_REMOVED_LATER": None},
                                    str(tmp_path))
    monkeypatch.setenv("TZ", "Asia/Kolkata")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
    mask = os.umask(0o077)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(nofile[0], 1000), nofile[1]))
        facts = ddp_notebook.launch(worker_facts, devices="cpu:0").wait(timeout=60)
    finally:
        os.umask(mask)
        resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
    assert facts["path"][0] == str(tmp_path / "added_later")
    assert (facts["umask"], facts["nofile"], facts["tz"], facts["tmp"]) == (0o077, min(nofile[0], 1000), "IST",
                                                                          str(tmp_path))
    assert forkserver.status()["pid"] == server.pid  # none of these is read when torch is imported


def read_at_import(ctx):
    with open(f"/proc/{os.getppid()}/environ", "rb") as f:  # the server's, as it was started
        server_env = dict(line.split(b"=", 1) for line in f.read().split(b"\0") if b"=" in line)
    return os.environ.get("TORCH_DDP_NB_PROBE"), server_env.get(b"TORCH_DDP_NB_PROBE")


def test_a_variable_torch_reads_at_import_replaces_the_server(monkeypatch):
    old = _server()
    monkeypatch.setenv("TORCH_DDP_NB_PROBE", "set after the server started")
    seen = ddp_notebook.launch(read_at_import, devices="cpu:0").wait(timeout=120)
    assert seen == ("set after the server started", b"set after the server started")
    assert forkserver.status()["pid"] != old.pid
    wait_until(lambda: has_ended(old.pid), timeout=30)


def test_a_variable_torchs_own_import_sets_keeps_the_server(monkeypatch):
    forkserver.stop()
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    server = _server()  # its import of torch._dynamo sets TORCHINDUCTOR_CACHE_DIR in the server
    made = forkserver._server.set_by_imports
    assert "TORCHINDUCTOR_CACHE_DIR" in made
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", made["TORCHINDUCTOR_CACHE_DIR"])  # as an optimizer step does here
    assert ddp_notebook.launch(faults.ddp_steps, devices="cpu*2").wait(timeout=120) == [32.0, 32.0]
    assert forkserver.status()["pid"] == server.pid  # the same server: nothing it read has changed


def test_variables_torch_reads_when_called_keep_the_server_and_reach_the_workers(monkeypatch):
    server = _server()
    names = ("PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")
    monkeypatch.setenv("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # what `import lightning` sets
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/elsewhere")  # a cache the user chose
    seen = ddp_notebook.launch(lambda ctx: [os.environ.get(n) for n in names], devices="cpu*2").wait(timeout=120)
    assert seen == ["1", "/elsewhere"]
    assert forkserver.status()["pid"] == server.pid
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # read by the OpenMP runtime as torch loads it: a new server
    assert ddp_notebook.launch(faults.ddp_steps, devices="cpu*2").wait(timeout=120) == [32.0, 32.0]
    assert forkserver.status()["pid"] != server.pid


def test_faults_on_either_rank_are_blamed_on_that_rank():
    _server()
    for fault in ("raise", "exit", "sigkill", "segfault"):
        for bad in (0, 1):
            run = ddp_notebook.launch(faults.ddp_steps, devices="cpu*2", kwargs={"fault": fault, "bad_rank": bad})
            with pytest.raises(ddp_notebook.WorkerFailedError) as err:
                run.wait(timeout=60)
            assert err.value.failure.rank == bad, (fault, bad, err.value.failure)
    assert forkserver.status()["ready"]


def test_a_killed_server_fails_its_runs_at_once_and_the_next_launch_starts_another():
    server = _server()
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2")
    wait_for(run, lambda s: all(w.step for w in s.workers.values()), timeout=60)
    server.send_signal(signal.SIGKILL)
    with pytest.raises(ddp_notebook.WorkerFailedError, match=r"Every distributed data parallel worker \(cpu:0, cpu:1\) "
                       rf"failed the same way: the fork server \(pid {server.pid}\) that started it ended "
                       r"\(SIGKILL\), and Linux ended the workers it had forked with it") as err:
        run.wait(timeout=60)
    assert err.value.failure.kind == "server"  # the run's failure, not one rank's
    assert all(has_ended(w.pid) for w in run.workers)
    assert ddp_notebook.launch(faults.ddp_steps, devices="cpu*2").wait(timeout=120) == [32.0, 32.0]
    assert forkserver.status()["pid"] != server.pid


def _left_by_ranks(folder) -> list[int]:
    """The pids the ranks of ``faults.leaves_subprocesses`` noted."""
    wait_until(lambda: all(os.path.exists(os.path.join(folder, f"rank{r}")) for r in (0, 1)), timeout=60)
    return [int(pid) for r in (0, 1) for pid in open(os.path.join(folder, f"rank{r}")).read().split()]


@pytest.mark.parametrize("then", ["return", "raise", "sigkill"])
def test_what_a_forked_rank_started_ends_with_it(tmp_path, then):
    """A forked worker has no watcher of its own: the server, its parent, ends the worker's
    process group as soon as the worker exits, however it exits."""
    _server()
    run = ddp_notebook.launch(faults.leaves_subprocesses, devices="cpu*2", args=(str(tmp_path), then))
    if then == "return":
        assert run.wait(timeout=60) == 0
    else:
        with pytest.raises(ddp_notebook.WorkerFailedError):
            run.wait(timeout=60)
    left = _left_by_ranks(tmp_path)
    wait_until(lambda: all(has_ended(pid) for pid in left), timeout=10)


def test_what_forked_ranks_started_ends_when_the_server_is_killed(tmp_path):
    """The server's reaper, told each worker's group, ends them once the server is gone."""
    server = _server()
    reaper = psutil.Process(forkserver.status()["reaper"])
    assert reaper.ppid() == server.pid and reaper.name() == "ddp-reaper"
    run = ddp_notebook.launch(faults.leaves_subprocesses, devices="cpu*2", args=(str(tmp_path), "wait"))
    left = _left_by_ranks(tmp_path)
    server.send_signal(signal.SIGKILL)
    with pytest.raises(ddp_notebook.WorkerFailedError, match="the fork server"):
        run.wait(timeout=60)
    wait_until(lambda: all(has_ended(pid) for pid in left), timeout=10)
    wait_until(lambda: has_ended(reaper.pid), timeout=10)


def test_a_killed_reaper_is_forked_again_and_knows_the_running_workers(tmp_path):
    server = _server()
    run = ddp_notebook.launch(faults.leaves_subprocesses, devices="cpu*2", args=(str(tmp_path), "wait"))
    left = _left_by_ranks(tmp_path)
    first = forkserver.status()["reaper"]
    os.kill(first, signal.SIGKILL)
    wait_until(lambda: forkserver.status()["reaper"] != first, timeout=30)
    again = psutil.Process(forkserver.status()["reaper"])
    wait_until(lambda: again.name() == "ddp-reaper", timeout=10)
    assert again.ppid() == server.pid
    server.send_signal(signal.SIGKILL)
    with pytest.raises(ddp_notebook.WorkerFailedError, match="the fork server"):
        run.wait(timeout=60)
    wait_until(lambda: all(has_ended(pid) for pid in left), timeout=10)


def test_a_server_that_cannot_import_torch_leaves_launches_to_fresh_workers(monkeypatch, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "torch.py").write_text(textwrap.dedent("""
        raise ImportError("no torch in this environment")
    """))
    monkeypatch.setenv("PYTHONPATH", f"{broken}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    run = ddp_notebook.launch(faults.environment, devices="cpu*2", args=((),))
    with pytest.raises(ddp_notebook.WorkerFailedError, match="no torch in this environment"):
        run.wait(timeout=120)
    failed = forkserver.status()
    assert "no torch in this environment" in failed["error"]
    server = forkserver._server  # (what it was judged by, said should the next launch start another)
    seen = (server.key, server.started_ok, server.unresponsive) if server is not None else None
    # Nothing changed: the next launch does not start a server that would fail the same way.
    with pytest.raises(ddp_notebook.WorkerFailedError, match="no torch in this environment"):
        ddp_notebook.launch(faults.environment, devices="cpu:0", args=((),)).wait(timeout=120)
    assert forkserver.status()["pid"] == failed["pid"], (seen, forked.staleness())
    monkeypatch.undo()
    assert ddp_notebook.launch(faults.ddp_steps, devices="cpu*2").wait(timeout=120) == [32.0, 32.0]
    assert forkserver.status()["error"] is None


def test_a_server_stopped_while_it_imports_torch_ends_at_once(monkeypatch, tmp_path):
    slow = tmp_path / "slow"
    slow.mkdir()
    (slow / "torch.py").write_text("import time\ntime.sleep(600)\n")  # an import that takes its time
    monkeypatch.setenv("PYTHONPATH", f"{slow}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    forkserver.start()
    server = psutil.Process(forkserver.status()["pid"])
    assert not forkserver.status()["ready"]
    forkserver.stop()  # %unload_ext: it has forked nothing, and would read nothing until its import ends
    wait_until(lambda: has_ended(server.pid), timeout=60)
    monkeypatch.undo()


def test_disabled_every_worker_is_a_fresh_interpreter():
    forkserver.disable()
    try:
        assert forkserver.status() == {"enabled": False, "used": False, "running": False, "ready": False, "pid": None,
                                       "error": None, "threads": None, "reaper": None}
        facts = ddp_notebook.launch(facts_of_every_rank, devices="cpu*2").wait(timeout=120)
        assert all(f["parent"] == os.getpid() and f["name"] == "python" for f in facts), facts
    finally:
        forkserver.enable()


def test_stop_waits_for_the_runs_it_forked():
    server = _server()
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2")
    wait_for(run, lambda s: all(w.step for w in s.workers.values()), timeout=60)
    forkserver.stop()
    assert server.is_running()  # its workers are still running
    run.stop()
    run.wait(timeout=60)
    wait_until(lambda: has_ended(server.pid), timeout=30)


def test_a_launch_while_the_server_imports_torch_returns_at_once_and_can_be_stopped(tmp_path):
    forkserver.stop()
    run = ddp_notebook.launch(faults.marks_its_start_then_waits, devices="cpu*2", args=(str(tmp_path),))
    assert not forkserver.status()["ready"] and run.status == "starting"  # launch did not wait for it
    assert run.state.waiting_for == "importing torch once for this notebook"
    assert "starting workers (importing torch once for this notebook)" in format_run(run.state)
    run.stop()  # before any worker exists: none is started, and the run ends at once
    with pytest.raises(ddp_notebook.errors.RunStoppedError):
        run.wait(timeout=120)
    assert run.status == "stopped" and not run.failures
    assert [w.status for w in run.workers] == ["stopped", "stopped"] and run.pids() == [None, None]
    server = _server()
    assert ddp_notebook.launch(facts_of_every_rank, devices="cpu*2").wait(timeout=60)[0]["parent"] == \
        server.pid  # the server went on starting, for the next launch
    # The workers the stopped run asked for (each sent its assignment with the request) were
    # forked before the next run's, once the server was ready, and ended: the function never ran.
    wait_until(lambda: [p.name() for p in server.children()] == ["ddp-reaper"], timeout=60)
    assert not list(tmp_path.iterdir())


def test_a_stopped_server_delays_no_launch_and_is_ended_once_its_runs_are_done():
    server = _server()
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2")
    wait_for(run, lambda s: all(w.step for w in s.workers.values()), timeout=60)
    server.suspend()  # a debugger, or SIGSTOP: it answers nothing
    try:
        started = time.monotonic()
        after = ddp_notebook.launch(facts_of_every_rank, devices="cpu*2")
        took = time.monotonic() - started
        facts = after.wait(timeout=120)
        assert all(f["parent"] == os.getpid() for f in facts)  # fresh interpreters, without the stopped server
        # the launch did not wait for it: a launch that did would wait out FORK_TIMEOUT (15 s); a busy
        # machine may take a second or two for what launch itself does
        assert took < forkserver.FORK_TIMEOUT / 3 and after.state.started_at is not None, took
        assert f"(pid {server.pid}) is stopped" in forkserver.status()["error"]
        assert server.is_running()  # the run it forked still runs: the server goes once that run is done
        run.stop()
        assert run.wait(timeout=60).startswith("stopped at step")  # its exits read from /proc
        wait_until(lambda: has_ended(server.pid), timeout=30)  # ended while still stopped
    finally:
        if not has_ended(server.pid):
            server.resume()
    assert ddp_notebook.launch(facts_of_every_rank, devices="cpu*2").wait(timeout=120)[0]["parent"] not in (
        os.getpid(), server.pid)  # the next launch forks from a new server


def test_a_wedged_server_is_given_up_on_and_the_run_goes_on_without_it(monkeypatch):
    server = _server()
    monkeypatch.setattr(forkserver, "FORK_TIMEOUT", 2.0)
    # Wedged: alive, not stopped as far as the notebook can tell, and answering nothing. (Stopped
    # here, with its stopped state hidden: only the timeout can find it.)
    server.suspend()
    monkeypatch.setattr(psutil.Process, "status", lambda self: psutil.STATUS_SLEEPING)
    try:
        run = ddp_notebook.launch(facts_of_every_rank, devices="cpu*2")
        assert all(f["parent"] == os.getpid() for f in run.wait(timeout=120))
        assert f"(pid {server.pid}) did not answer in 2 s" in forkserver.status()["error"]
    finally:
        monkeypatch.undo()
    wait_until(lambda: has_ended(server.pid), timeout=30)  # ended: it had no run of its own left
