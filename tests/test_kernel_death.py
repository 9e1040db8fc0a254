"""No process outlives the notebook: a real kernel killed by SIGKILL leaves no worker, and nothing a
worker started, behind (#11 item 9).

One kernel holds all four cases at once, each in processes of its own, so that one start and one
kill (a few seconds of ``import torch``) test them all, and each case still passes or fails alone:

- (a) a run whose lifeline pipes a helper forked by the kernel holds open (the helper is forked
  after that run started and before the others, so it holds only that run's pipes);
- (b) a run whose rank holds the GIL in C code (no Python thread of the worker can run);
- (c) a run whose rank started a subprocess and left it running;
- (d) workers started as fresh interpreters (no fork server), still importing torch when the
  kernel dies;
- (e) a rank that started a subprocess and then failed, while a cell holds the GIL, so the
  notebook's supervisor cannot end what the rank left before the kernel dies;
- (f) a fork server still importing torch (the runs above were forked by another one, which
  is "nothing else of the kernel").
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from helpers import wait_until

# The bound: nothing of a run may be left this long after the kernel's death.
LIMIT = 2.0
# How long the leftovers are watched, to say when they went (the code before the fix: never, or
# once the workers' import of torch is done).
WATCH = 8.0

CELL = '''
import ctypes, json, os, subprocess, time, ddp_notebook

def report(marker, **pids):
    with open(marker + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(marker + ".tmp", marker)

def idle(ctx, marker):                 # (a) an ordinary rank, waiting to be stopped
    report(marker, worker=os.getpid())
    while not ctx.should_stop:
        time.sleep(0.05)

def holds_the_gil(ctx, marker):        # (b) C code that never lets the GIL go
    report(marker, worker=os.getpid())
    ctypes.PyDLL(None).sleep(600)

def starts_a_subprocess(ctx, marker):  # (c) a child that the rank never ends
    child = subprocess.Popen(["sleep", "600"])
    report(marker, worker=os.getpid(), child=child.pid)
    while not ctx.should_stop:
        time.sleep(0.05)
def fails_leaving_a_subprocess(ctx, marker):  # (e) fails once the cell holds the GIL
    child = subprocess.Popen(["sleep", "600"])
    report(marker, worker=os.getpid(), child=child.pid)
    while not os.path.exists(marker + ".go"):
        time.sleep(0.02)
    raise ValueError("fails, leaving its subprocess")
'''

START = '''
run_a = ddp_notebook.launch(idle, devices="cpu:0", args=({a!r},))
helper = os.fork()                     # (a) holds the pipes of run_a, and only those
if helper == 0:
    time.sleep(600)
    os._exit(0)
run_b = ddp_notebook.launch(holds_the_gil, devices="cpu:0", args=({b!r},))
run_c = ddp_notebook.launch(starts_a_subprocess, devices="cpu:0", args=({c!r},))
run_e = ddp_notebook.launch(fails_leaving_a_subprocess, devices="cpu:0", args=({e!r},))
'''
# (e): the rank fails while this cell holds the GIL (sum over a range never lets it go)
HOLD = 'open({e!r} + ".go", "w").close(); sum(range(3 * 10**9))'

# (d, f) the last cell: a run on two fresh interpreters (the fork server off), then a new fork server
# (the one that forked the runs above ends once they do); the kernel is killed soon after it replies.
LAST = '''
import psutil
from ddp_notebook.executors.local import forkserver
forkserver.disable()
run_d = ddp_notebook.launch(idle, devices="cpu*2", args=({d!r},))
fresh, deadline = [], time.monotonic() + 60
def command(p):  # (a child may end meanwhile: the run's git lookup, for one)
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""
while len(fresh) < 2 and time.monotonic() < deadline:  # the run's own thread starts them
    fresh = [c.pid for c in psutil.Process().children() if "ddp_notebook.worker.process" in command(c)]
    time.sleep(0.01)
forkserver.enable()
forkserver.start()
print(json.dumps({{"fresh": fresh, "server": forkserver.status()["pid"], "kernel": os.getpid(), "helper": helper}}))
'''

CASES = {"a": "a forked helper holds the lifeline open", "b": "a rank holds the GIL",
         "c": "a rank's subprocess", "d": "fresh workers importing torch",
         "e": "a failed rank's subprocess, the notebook holding the GIL",
         "f": "a fork server importing torch"}


def _running(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE  # an orphan that has exited waits to be reaped
    except psutil.NoSuchProcess:
        return False


def _describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:100]}"
    except psutil.NoSuchProcess:
        return f"{p.pid} (gone)"


def _kill(procs) -> None:
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def _execute(kc, code: str) -> str:
    out: list[str] = []
    reply = kc.execute_interactive(code, timeout=120, output_hook=lambda m: out.append(
        m["content"].get("text", "") if m["msg_type"] == "stream" else ""))
    assert reply["content"]["status"] == "ok", (reply["content"], out)
    return "".join(out)


def _case_of(proc: psutil.Process, roots: dict[int, str]) -> str:
    """The case a process belongs to: that of the worker it descends from."""
    try:
        for p in [proc] + proc.parents():
            if p.pid in roots:
                return roots[p.pid]
    except psutil.NoSuchProcess:
        pass
    return "other"


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """Run the four cases in one kernel, kill it with SIGKILL, and watch what is left: for each
    case, when its last process went (None: not within ``WATCH``) and those still running at
    ``LIMIT``. Whatever is left is killed before any test looks, so no test inherits it."""
    from helpers import started_kernel

    tmp = tmp_path_factory.mktemp("kernel_death")
    markers = {case: str(tmp / case) for case in "abce"}
    last = LAST.format(d=str(tmp / "d"))
    km, kc = started_kernel()
    tree: list[psutil.Process] = []
    try:
        _execute(kc, CELL)
        _execute(kc, START.format(**markers))
        wait_until(lambda: all(os.path.exists(m) for m in markers.values()), timeout=120)
        pids = {case: json.load(open(m)) for case, m in markers.items()}
        info = json.loads(_execute(kc, last).strip().splitlines()[-1])
        assert len(info["fresh"]) == 2, info
        kernel = psutil.Process(info["kernel"])
        tree = kernel.children(recursive=True)
        roots = {pids[case]["worker"]: case for case in "abce"} | {pid: "d" for pid in info["fresh"]}
        roots[info["server"]] = "f"
        roots[info["helper"]] = "helper"  # the user's own fork: not ours to end
        cases = {p.pid: _case_of(p, roots) for p in tree}  # before the kill: orphans have no ancestry
        assert cases.get(pids["c"]["child"]) == "c" and cases.get(pids["e"]["child"]) == "e", cases
        kc.execute(HOLD.format(**markers))  # not waited for: it holds the GIL until the kill
        failed = psutil.Process(pids["e"]["worker"])
        wait_until(lambda: not _running(failed), timeout=60)
        kernel.send_signal(signal.SIGKILL)
        results = _watch(tree, cases, time.monotonic())
    finally:
        _kill([p for p in tree if _running(p)])
        kc.stop_channels()
        try:
            km.shutdown_kernel(now=True)
        except Exception:  # noqa: BLE001 - it was killed: only its resources are left to free
            km.cleanup_resources()
    yield results


def _watch(tree: list[psutil.Process], cases: dict[int, str], killed_at: float) -> dict:
    """Poll the processes of each case until all are gone or ``WATCH`` has passed."""
    watched = set(cases.values()) - {"helper"}
    gone: dict[str, float] = {}
    left: dict[str, list[str]] = {}
    while time.monotonic() - killed_at < WATCH and len(gone) < len(watched):
        elapsed = time.monotonic() - killed_at
        alive = [p for p in tree if _running(p)]
        for case in watched - set(gone):
            mine = [p for p in alive if cases[p.pid] == case]
            if not mine:
                gone[case] = elapsed
            elif elapsed <= LIMIT:
                left[case] = [_describe(p) for p in mine]
        time.sleep(0.02)
    return {case: (gone.get(case), left.get(case, []) if gone.get(case, WATCH) > LIMIT else []) for case in watched}


def _check(killed, case: str) -> None:
    went, left = killed[case]
    when = f"more than {WATCH:.0f} s" if went is None else f"{went:.2f} s"
    print(f"({case}) {CASES[case]}: last process gone after {when}")
    assert not left and went is not None and went <= LIMIT, \
        f"({case}) {CASES[case]}: still running {LIMIT} s after the kernel's death: {left}"


@pytest.mark.kernel
def test_a_helper_forked_by_the_kernel_does_not_keep_workers_alive(killed):
    _check(killed, "a")


@pytest.mark.kernel
def test_a_rank_holding_the_gil_dies_with_the_kernel(killed):
    _check(killed, "b")


@pytest.mark.kernel
def test_subprocesses_of_a_rank_die_with_the_kernel(killed):
    _check(killed, "c")


@pytest.mark.kernel
def test_fresh_workers_still_importing_torch_die_with_the_kernel(killed):
    _check(killed, "d")


@pytest.mark.kernel
def test_subprocesses_of_a_failed_rank_die_with_the_kernel(killed):
    _check(killed, "e")


@pytest.mark.kernel
def test_a_fork_server_importing_torch_dies_with_the_kernel(killed):
    _check(killed, "f")


@pytest.mark.kernel
def test_nothing_else_of_the_kernel_is_left(killed):
    went, left = killed.get("other", (0.0, []))
    assert not left, left


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")


@linux_only
@pytest.mark.processes
def test_a_worker_started_from_a_thread_that_then_ends_lives_on():
    # Linux kills a worker when the *thread* that started it ends: a run's own thread starts its
    # fresh interpreters, and users may launch from threads of their own.
    from ddp_notebook.executors.local.processes import spawn_process
    from ddp_notebook.worker.boot import EXIT_ORPHANED

    started, tied = [], []

    def start():
        started.append(spawn_process())
        # Until the worker is tied to its parent (its watcher is forked), the thread's end is no test.
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not tied:
            tied.extend(psutil.Process(started[0].proc.pid).children())
            time.sleep(0.02)

    thread = threading.Thread(target=start)
    thread.start()
    thread.join()
    try:
        assert started and tied, "the worker was never tied to the notebook process"
        # Linux sends a thread's death signal before it lets the thread's task go: once the task is
        # gone, a worker tied to that thread has SIGKILL pending and runs no further line.
        wait_until(lambda: not os.path.exists(f"/proc/self/task/{thread.native_id}"), timeout=30)
        worker = started[0]
        os.close(worker.control_fd)  # asked to leave: a worker alive reads EOF, and leaves on its own
        worker.control_fd = None
        code = worker.proc.wait(timeout=120)
        assert code == EXIT_ORPHANED, f"the worker died with the thread that started it (exit status {code})"
    finally:
        for p in started:
            try:
                os.killpg(p.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.discard()


@linux_only
@pytest.mark.processes
def test_a_worker_whose_notebook_died_before_it_was_tied_to_it_leaves_at_once():
    # The notebook may die between starting a worker and the worker asking for the death signal:
    # the worker then has another parent than the one it was told of.
    from ddp_notebook.executors.local.processes import _BOOT_SCRIPT
    from ddp_notebook.worker.boot import EXIT_ORPHANED, MODULE

    elsewhere = 1 if os.getpid() != 1 else 2
    done = subprocess.run([sys.executable, _BOOT_SCRIPT, MODULE, str(elsewhere)], capture_output=True,
                          start_new_session=True, timeout=60)
    assert done.returncode == EXIT_ORPHANED, done.stderr
