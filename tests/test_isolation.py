"""A local run listens on loopback only, and its workers never outlive the notebook process."""
import ipaddress
import os
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

import ddp_notebook

import faults
import tutorial_ddp
from helpers import has_ended, wait_for

pytestmark = pytest.mark.processes


@pytest.mark.parametrize("how", ["launch", "spawn"])
def test_local_run_listens_on_loopback_only(how):
    # spawn: tutorial code with its own env:// rendezvous, whose TCPStore the notebook serves
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2") if how == "launch" else \
        ddp_notebook.spawn(tutorial_ddp.waits_for_stop, args=(2,), nprocs=2, join=False)
    try:
        wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
        listening = []
        for proc in [psutil.Process()] + psutil.Process().children(recursive=True):
            try:
                listening += [c.laddr for c in proc.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
            except psutil.NoSuchProcess:  # a process of an earlier test, ending now: it listens nowhere
                pass
        # gloo does listen (each pair connects over TCP), but never on a routable address
        assert listening, "expected gloo's listeners to be visible"
        assert all(ipaddress.ip_address(a.ip).is_loopback for a in listening), listening
    finally:
        run.stop(grace=5, wait=True)


ORPHAN_SCRIPT = textwrap.dedent("""
    import sys, ddp_notebook
    sys.path.insert(0, {tests!r})
    import faults
    from ddp_notebook.executors.local import forkserver
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2")
    import threading
    seen = threading.Event()
    run.subscribe(lambda e: seen.set() if all((w.step or 0) >= 1 for w in run.state.workers.values()) else None)
    seen.wait(60)
    print(" ".join(str(w.pid) for w in run.workers), flush=True)
    print(forkserver.status()["pid"], flush=True)  # the fork server must go too
    threading.Event().wait()  # a busy kernel, until it is killed
""")


def test_workers_exit_when_the_notebook_process_dies():
    script = ORPHAN_SCRIPT.format(tests=os.path.dirname(__file__))
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in kernel.stdout.readline().split()]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    pids.append(int(kernel.stdout.readline()))
    kernel.send_signal(signal.SIGKILL)
    kernel.wait()
    # An orphan that exited stays a zombie until its new parent (init, or a subreaper) reaps it:
    # it has exited all the same.
    # They go at once (SIGKILL from Linux); a busy machine may take seconds to run their exits.
    deadline = time.monotonic() + 60
    while (alive := [p for p in pids if not has_ended(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive, f"workers outlived their notebook: {alive}"
    kernel.stdout.close()


CUT_OFF_SCRIPT = textwrap.dedent("""
    import sys, threading, time, ddp_notebook
    sys.path.insert(0, {tests!r})
    import faults
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2", args=({honour},))
    seen = threading.Event()
    run.subscribe(lambda e: seen.set() if all((w.step or 0) >= 1 for w in run.state.workers.values()) else None)
    seen.wait(60)
    if {stop}:  # asked to stop, by workers that take their time (the grace is long): the kernel dies first
        run.stop(grace=600)
        while run.state.stop_reason is None:
            time.sleep(0.01)
    print(run.run_dir, flush=True)
    threading.Event().wait()
""")


@pytest.mark.parametrize("stop", [False, True], ids=["running", "stopping"])
def test_a_run_cut_off_by_the_kernels_death_reloads_as_stopped_with_the_reason(stop):
    script = CUT_OFF_SCRIPT.format(tests=os.path.dirname(__file__), honour=not stop, stop=stop)
    kernel = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    run_dir = kernel.stdout.readline().strip()
    kernel.send_signal(signal.SIGKILL)
    kernel.wait()
    kernel.stdout.close()
    run = ddp_notebook.Run.load(run_dir)
    assert run.status == "stopped" and [w.status for w in run.workers] == ["stopped", "stopped"]
    # The stop asked is said (it was lost: the reading said a crash alone), then the notebook's end.
    asked = "stopped by the user, then " if stop else ""
    assert run.state.stop_reason.startswith(f"{asked}the notebook process ended (kernel restart or crash) at step ")
    assert run.state.notebook_ended
    with pytest.raises(ddp_notebook.errors.RunStoppedError, match=rf"was stopped \({asked}the notebook process ended \(kernel restart"):
        run.wait()
    from ddp_notebook.ui.text import format_run

    assert format_run(run.state).startswith(f"Run {run.id} stopped after ")


def test_a_run_read_back_in_the_notebook_process_that_runs_it_stops_it(tmp_path):
    # Run.load(id).stop() here said the run was in "another notebook process, which alone can stop it".
    run = ddp_notebook.launch(faults.wait_for_stop, devices="cpu*2", run_root=str(tmp_path))
    wait_for(run, lambda s: all((w.step or 0) >= 1 for w in s.workers.values()))
    ddp_notebook.Run.load(run.run_dir).stop(wait=True)
    assert run.status == "stopped" and run.state.stop_reason == "stopped by the user"


def test_workers_import_the_notebooks_copy_of_the_package_not_one_in_the_working_directory(tmp_path):
    # A clone of the package next to the notebook: `python -m` would have put it first in the workers.
    (tmp_path / "elsewhere" / "ddp_notebook").mkdir(parents=True)
    (tmp_path / "elsewhere" / "ddp_notebook" / "__init__.py").write_text("raise ImportError('the wrong copy')\n")
    (tmp_path / "script").mkdir()
    (tmp_path / "script" / "main.py").write_text(textwrap.dedent("""
        import ddp_notebook
        def where(ctx):
            import ddp_notebook
            return ddp_notebook.__file__
        print(ddp_notebook.launch(where, devices="cpu*2").wait(timeout=120))
    """))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(tmp_path / "script" / "main.py")], cwd=tmp_path / "elsewhere",
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": root, "DDP_NOTEBOOK_PROGRESS": "0"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == os.path.join(root, "ddp_notebook", "__init__.py")
