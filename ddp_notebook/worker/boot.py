"""How a worker process is started: what the local executor and ``process.main`` agree on, and the
first code a worker runs.

The local executor runs this file as a script, ``python .../worker/boot.py MODULE PARENT_PID``, with
``BOOT_ENV`` holding the numbers of two inherited pipe ends (``event_fd`` to report,
``control_fd`` to hear) and whether the process is pooled. Before anything is imported (the
package, torch: seconds, more under load) the worker ties its life to the notebook process
(``tie_to_parent``), then runs ``MODULE`` (``process``) as ``__main__``. The assignment (a
``RankConfig``) arrives as one frame on the control pipe.

Only the standard library here: this module runs before the package is importable.
"""
from __future__ import annotations

import functools
import os
import signal
import sys

TYPE_CHECKING = False  # typing itself is not imported before the tie: it costs time
if TYPE_CHECKING:
    from collections.abc import Callable

    Prctl = Callable[[int, int, int, int, int], int]

__all__ = ["MODULE", "ZYGOTE_MODULE", "READY", "FORKED", "FAILED", "EXITED", "REAPER", "BOOT_ENV", "WATCHER_ENV",
           "EXIT_FAILED", "EXIT_ORPHANED", "STACK_SIGNAL", "tie_to_parent", "take_watcher", "dismiss_watcher",
           "set_name"]

MODULE = "ddp_notebook.worker.process"
ZYGOTE_MODULE = "ddp_notebook.worker.zygote"  # the fork server (``zygote``), run the same way
# The keys of the fork server's messages to the notebook (``zygote``; nothing may import that module,
# which runs as ``__main__``).
READY, FORKED, FAILED, EXITED, REAPER = "ready", "forked", "failed", "exited", "reaper"
BOOT_ENV = "DDP_NOTEBOOK_WORKER"
WATCHER_ENV = "DDP_NOTEBOOK_WATCHER"  # the pid of the worker's watcher (see ``tie_to_parent``), for ``process``
EXIT_FAILED = 1  # the rank reported an error
EXIT_ORPHANED = 75  # the notebook process went away
# The signal that makes a rank dump its stacks for the stall watchdog: a real-time signal where
# there is one, so user code that handles SIGUSR1 (a cluster's checkpoint-and-requeue handler) is
# never triggered by the watchdog, nor hides the dump.
STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_PR_SET_NAME = 15
# What the watcher is sent when the worker dies; any signal would do (it blocks them all and
# checks its parent), this one is sent by nobody else.
_WATCH_SIGNAL = signal.SIGRTMIN + 4 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2


def tie_to_parent(parent: int, watch: bool = True) -> None:
    """Tie this worker, and every process it will start, to the notebook process ``parent``.

    The OS kills the worker (SIGKILL) the moment its parent dies: no pipe a forked helper of the
    notebook could hold open, no thread of the worker (a rank may hold the GIL in C code for
    minutes), nothing that waits for ``import torch`` to finish. A tiny watcher, forked now, ends
    the worker's process group once the worker is gone, however it went, so subprocesses of the
    training function (which SIGKILL gives no chance to end) go too.

    Linux only (``PR_SET_PDEATHSIG``); elsewhere the lifeline pipe alone ends workers, as before.
    Linux sends the signal when the parent *thread* ends: the local executor starts every process from one
    thread that lives as long as the notebook process (``executors.local.spawner``), and the fork
    server, the parent of the workers it forks, has one thread. Without ``watch``, no watcher: the
    fork server's group holds nothing else (each worker it forks leads its own), and the server
    ends the groups of the workers it forks itself (``zygote``).
    """
    prctl = _prctl()
    if prctl is None or prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    # The notebook may have died before the line above: the signal would never come.
    if os.getppid() != parent:
        os._exit(EXIT_ORPHANED)
    # Killing the process group is only right for a worker that leads its own (the executor
    # starts it in a new session); never reach the group of whoever ran this file otherwise.
    if watch and os.getpgid(0) == os.getpid():
        os.environ[WATCHER_ENV] = str(_fork_watcher(prctl))


def take_watcher() -> int:
    """The watcher's pid (0: none), taken out of the environment before the run's replaces it
    and before the user's code could see it."""
    return int(os.environ.pop(WATCHER_ENV, "0"))


def dismiss_watcher(pid: int) -> None:
    """End and collect the watcher ``pid`` before the worker leaves on its own, so no exited
    watcher waits for init to collect it; unless the worker has other children (a subprocess of
    the training function): then the watcher stays, to end them once the worker is gone, even
    when the notebook dies before its supervisor would have."""
    if pid and not _has_other_children(pid):
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except OSError:  # already collected (the user's code set SIGCHLD to SIG_IGN, or waited)
            pass


def _has_other_children(watcher: int) -> bool:
    """Whether this process has a child besides ``watcher`` (True when Linux cannot tell)."""
    try:
        tasks = os.listdir("/proc/self/task")
        for tid in tasks:
            with open(f"/proc/self/task/{tid}/children") as f:
                if any(int(child) != watcher for child in f.read().split()):
                    return True
    except OSError:
        return True
    return False


def set_name(name: bytes) -> None:
    """The name ``ps``, ``top`` and ``/proc/PID/comm`` show for this process (Linux; at most 15
    bytes): a forked worker keeps the fork server's command line, its name says what it is."""
    prctl = _prctl()
    if prctl is not None:
        import ctypes

        buf = ctypes.create_string_buffer(name[:15])
        prctl(_PR_SET_NAME, ctypes.addressof(buf), 0, 0, 0)


@functools.cache
def _prctl() -> Prctl | None:
    """libc's ``prctl``, or None off Linux (found once: a forked worker finds it in its server)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (ImportError, OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    prctl.restype = ctypes.c_int
    return prctl


def _fork_watcher(prctl: Prctl) -> int:
    """Fork the watcher: a copy of this still bare interpreter that waits, holding nothing, for the
    worker's death, then SIGKILLs the worker's process group (itself included)."""
    worker = os.getpid()
    pid = os.fork()
    if pid:
        return pid
    try:
        # Signals sent to the group (the supervisor's SIGTERM, the user's) must not end it early.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        set_name(b"ddp-watcher")
        os.closerange(0, 1 << 16)  # no pipe of the worker's kept open: their EOF is how it is seen to die
        prctl(_PR_SET_PDEATHSIG, _WATCH_SIGNAL, 0, 0, 0)
        # A parent thread of the worker may end before the worker does (the signal comes then too):
        # wait until the worker is really gone, which reparents the watcher.
        while os.getppid() == worker:
            signal.sigwait({_WATCH_SIGNAL})
        os.killpg(0, signal.SIGKILL)
    finally:
        os._exit(0)


def _main() -> None:
    module, parent = sys.argv[1], int(sys.argv[2])
    # As a script, this file's folder is first on sys.path (unless -P / PYTHONSAFEPATH); the
    # package's parent must be first (this copy of the package, never one in the working
    # directory), before anything is imported.
    package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if getattr(sys.flags, "safe_path", False):
        sys.path.insert(0, package_parent)
    else:
        sys.path[0] = package_parent
    tie_to_parent(parent, watch=module != ZYGOTE_MODULE)
    del sys.argv[1:]
    _package_on_first_use(os.path.join(package_parent, "ddp_notebook"))
    import runpy

    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _package_on_first_use(folder: str) -> None:
    """Make ``ddp_notebook`` importable without running its ``__init__`` (the API and its front
    ends: ipywidgets and 220 modules, 0.2 s) until something asks the package for a name: a
    worker imports the submodules it runs itself; training code that uses the API gets it whole."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ddp_notebook", os.path.join(folder, "__init__.py"),
                                                  submodule_search_locations=[folder])
    if spec is None or spec.loader is None:
        return
    package = importlib.util.module_from_spec(spec)
    loader = spec.loader

    def first_use(name: str) -> object:
        del package.__getattr__  # (the package's own, if it has one, comes with it)
        loader.exec_module(package)
        return getattr(package, name)

    package.__getattr__ = first_use  # type: ignore[method-assign]
    sys.modules["ddp_notebook"] = package


if __name__ == "__main__":
    _main()
