"""Shared fixtures: every test fails if it leaves a worker process behind."""
from __future__ import annotations

import doctest
import json
import os
import re
import signal
import uuid

import psutil
import pytest

SLOW = ("processes", "kernel", "engines", "multihost", "browser", "quality", "fuzz", "trackers")
# Doctests of these modules start real runs; notebook cells run in a real kernel.
DOCTESTS_THAT_LAUNCH = ("ddp_notebook/__init__.py", "ddp_notebook/lifecycle/launch.py", "ddp_notebook/recipes/fit.py")
# A doctest example that calls one of these starts processes or opens sockets, wherever it is (an
# example marked +SKIP runs nothing): a module not listed above is a processes test all the same.
STARTS_SOMETHING = re.compile(r"(?<![\w.])(?:ddp_notebook\.)?(?:launch|spawn|fit)\(|\.(?:retry|start|start_and_connect_sync)\("
                              r"|\b(?:socket|subprocess)\.\w|TCPStore\(|\bMeeting\.")
NOTEBOOKS_WITH_ENGINES = ("04_scale_out.ipynb",)
DURATIONS = os.path.join(os.path.dirname(__file__), "tests", "durations.json")

# In the command line of every worker: a fresh one runs worker.process, a forked one keeps the fork
# server's (worker.zygote).
WORKER_MARK = "ddp_notebook.worker."
# Workers inherit this: the leak check finds this session's workers even after they were
# orphaned (re-parented away from us), and ignores those of another test session. Each
# pytest-xdist worker is a session of its own (it must not take another's ranks for its leaks).
SESSION = os.environ.setdefault("DDP_NOTEBOOK_TEST_SESSION", uuid.uuid4().hex)
if os.environ.get("PYTEST_XDIST_WORKER"):
    SESSION = os.environ["DDP_NOTEBOOK_TEST_SESSION"] = f"{SESSION}-{os.environ['PYTEST_XDIST_WORKER']}"


def _workers() -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and WORKER_MARK in " ".join(p.info["cmdline"] or ()) \
                    and p.environ().get("DDP_NOTEBOOK_TEST_SESSION") == SESSION:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return found


def _standing() -> set:
    """Processes kept between runs: the fork server."""
    from ddp_notebook.executors.local.executor import standing_processes

    return standing_processes()


def _alive(p: psutil.Process) -> bool:
    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _describe(p: psutil.Process) -> tuple:
    try:
        return p.pid, p.cmdline()
    except psutil.Error:
        return p.pid, "(ended)"


def _starts_something(item) -> bool:
    """Whether a doctest runs an example that starts processes or opens sockets."""
    return any(STARTS_SOMETHING.search(e.source) and not e.options.get(doctest.SKIP) for e in item.dtest.examples)


def pytest_ignore_collect(collection_path, config):
    """A module of the package without a doctest example holds no test: it is not imported just to
    find none (``--doctest-modules`` would import the framework integrations, Lightning's 3 s)."""
    package = config.rootpath / "ddp_notebook"
    if collection_path.suffix == ".py" and collection_path.is_relative_to(package) and collection_path.is_file():
        if ">>>" not in collection_path.read_text(encoding="utf-8"):
            return True
    return None


def pytest_collection_modifyitems(config, items):
    """Mark doctests and notebook cells by what they start; a test marked with none of the slow
    kinds is a unit test (``pytest -m unit`` runs only those: seconds, no process). A test marked
    ``unit`` and a slow kind at once (a ``processes`` test in a module marked ``unit``) is refused:
    ``-m unit`` would run it. Then the files longest first (``_longest_first``)."""
    mixed = []
    for item in items:
        path = str(item.fspath)
        if type(item).__name__ == "IPyNbCell":
            item.add_marker(pytest.mark.kernel)
            if path.endswith(NOTEBOOKS_WITH_ENGINES):
                item.add_marker(pytest.mark.engines)
        elif type(item).__name__ == "DoctestItem" and (path.endswith(DOCTESTS_THAT_LAUNCH) or _starts_something(item)):
            item.add_marker(pytest.mark.processes)
        slow = [name for name in SLOW if item.get_closest_marker(name)]
        if not slow:
            item.add_marker(pytest.mark.unit)
        elif item.get_closest_marker("unit"):
            mixed.append(f"{item.nodeid} ({', '.join(slow)})")
    if mixed:
        raise pytest.UsageError("marked unit and slow at once (take the unit mark off, e.g. the module's "
                                "pytestmark):\n  " + "\n  ".join(mixed))
    items[:] = _longest_first(items)


def _longest_first(items):
    """The test files in the order of the seconds they last took, longest first, each file's tests
    in their own order (``tests/durations.json``, written by ``scripts/durations.py``; a file not
    there counts 1 s a test). The two test processes take the files in this order, each the next
    one as it ends the last (``--dist loadfile --no-loadscope-reorder``), so that no long file
    starts last while the other has nothing left to do."""
    with open(DURATIONS, encoding="utf-8") as f:
        took = json.load(f)
    files: dict = {}
    for item in items:
        files.setdefault(item.nodeid.split("::")[0], []).append(item)
    order = sorted(files, key=lambda name: took.get(name, float(len(files[name]))), reverse=True)
    return [item for name in order for item in files[name]]


@pytest.fixture(scope="session")
def kept_between_tests() -> set:
    """Pids of processes a module's tests share (a kernel and its fork server, ``session_kernel``):
    the fixture that starts them adds them, and takes them out once they are ended."""
    return set()


@pytest.fixture(scope="session")
def shared_lab(tmp_path_factory, kept_between_tests):
    """One JupyterLab server for the browser tests of this test process (one takes seconds to start
    and to stop), started by the first that asks for ``lab`` (tests/test_browser.py): each test has a
    folder and a workspace of its own in it, and its kernels are shut down as it ends. Defined here,
    not where ``lab`` is: a fixture imported into several test modules is one per module."""
    from test_browser import serve_lab

    with serve_lab(tmp_path_factory.mktemp("lab")) as served:
        kept_between_tests.add(served.server.pid)
        try:
            yield served
        finally:
            kept_between_tests.discard(served.server.pid)


@pytest.fixture(autouse=True)
def sigint_handler_kept():
    """A test that presses Ctrl-C in this process leaves SIGINT's handler as it found it: a press
    held by a session (``hold_presses``) must not outlive its test and, pressed again later, re-send
    itself into another test (an xdist worker that takes it ends)."""
    before = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def no_leaked_processes(request, kept_between_tests):
    """Fail a test that leaves a worker (or any child process) running.

    This process's fork server is kept between runs: not a leak, nor are the processes a module's
    tests share (``kept_between_tests``). Notebook cells run by nbval are checked once their
    kernel is gone, at the end of the session."""
    if type(request.node).__name__ == "IPyNbCell":
        yield
        return
    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    yield
    # A worker whose notebook process was just shut down exits on its own within moments.
    _, alive = psutil.wait_procs([p for p in _workers() if p.pid not in _standing() | kept_between_tests],
                                 timeout=5)
    standing = _standing() | kept_between_tests
    # (one that ended meanwhile is a zombie until its parent reaps it: ended, not left running; the
    # reaper of a server killed outright is reparented to PID 1, which in a container may never reap)
    leaked = [p for p in alive if _alive(p)]
    leaked += [c for c in me.children(recursive=True) if c.pid not in before and c not in leaked
               and c.pid not in standing and _alive(c)]
    described = [_describe(p) for p in leaked]
    for p in leaked:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not leaked, f"processes left behind: {described}"


def pytest_configure(config):
    """Keep the event logs of test runs out of the user's cache: set before anything runs, the
    kernels nbval starts for the tutorials (before any fixture) inherit it too."""
    import tempfile

    os.environ["DDP_NOTEBOOK_RUNS"] = tempfile.mkdtemp(prefix="ddp-notebook-test-runs-")


def pytest_unconfigure(config):
    import shutil

    shutil.rmtree(os.environ.get("DDP_NOTEBOOK_RUNS", ""), ignore_errors=True)


@pytest.fixture(scope="session")
def ipython_shell():
    """One real IPython shell for the session (IPython's test shell can be started only once)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.testing.globalipapp import start_ipython

    return start_ipython() or InteractiveShell.instance()


def pytest_sessionfinish(session, exitstatus):
    """At the very end, after every kernel and pool is gone, no worker of this session may be left."""
    from ddp_notebook.executors.local import forkserver

    forkserver.stop()
    _, alive = psutil.wait_procs(_workers(), timeout=10)
    if alive:
        for p in alive:
            p.kill()
        print(f"\nworker processes left at the end of the session: {[p.pid for p in alive]}")
        session.exitstatus = 1
