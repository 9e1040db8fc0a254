"""The fork server: a clean interpreter that has imported torch and forks a worker for each rank.

Run as ``__main__`` by ``boot`` (``python .../worker/boot.py ddp_notebook.worker.zygote PID``),
tied to the notebook process like any worker, and started by ``executors.local.forkserver``. It
imports what a run needs (torch, torch.distributed, what DDP loads on first use, the worker's own
modules) and then only waits, on one thread, for requests on a Unix socket (``SOCK_SEQPACKET``,
one JSON message each):

- ``{"op": "fork", "id": N}`` with four descriptors (the event pipe's write end, the control
  pipe's read end, stdout, stderr): fork a worker; the answer is ``{"forked": N, "pid": PID}``.
- ``{"op": "reap", "pid": PID}``: collect the worker, whose exit was reported.

When a worker exits, ``{"exited": PID, "rc": RC}`` (``Popen``'s convention) is sent while the
worker is still a zombie: its pid, and so its process group id, stay its own until the notebook
asks for the reap, as for a ``Popen`` child. EOF on the socket ends the server.

Why it is safe to fork: the server never initialises CUDA, and holds no thread that forks badly
(the BLAS library's threads are stopped by its own fork handler). Each forked worker leads a new
session, is killed by Linux when the server dies (which the server is when the notebook dies), and
runs ``process`` as ``__main__``, exactly as a fresh interpreter would from there on.

What a worker leaves behind (processes the training function started, in its process group) is
ended by the server, the worker's parent, the moment it sees the worker's exit (SIGKILL to the
group, while the worker's pid, and so its group id, are still held by the unreaped worker); and,
should the server itself die, by its reaper: a bare copy of the server forked before torch is
imported, told every worker's group, which ends those not yet reaped once the server's pipe to it
closes (a reaper that dies is forked again, told every group). A worker forked here needs no
watcher of its own (``boot.tie_to_parent``): forking one from a process that has imported torch
cost 5 ms at its start and 8 ms at its end, a fifth of a relaunch.
"""
from __future__ import annotations

import builtins
import gc
import importlib.util
import json
import os
import select
import signal
import socket
import sys
import tempfile
import threading
import types
from typing import Any

from .boot import BOOT_ENV, EXIT_FAILED, EXITED, FAILED, FORKED, MODULE, READY, REAPER, set_name, tie_to_parent
from .execute import warm_up

_MAX_MESSAGE = 1 << 16


def _send(sock: socket.socket, message: dict[str, object]) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:  # the notebook is gone: the loop sees EOF next
        pass


def _exit_status(pid: int) -> int | None:
    """The exit status of child ``pid`` once it has exited, leaving it a zombie (``WNOWAIT``)."""
    try:
        found = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return -signal.SIGKILL  # collected already: cannot happen, but never wait on it forever
    if found is None:
        return None
    return found.si_status if found.si_code == os.CLD_EXITED else -found.si_status


def _take_process_state(state: dict[str, Any]) -> None:
    """The notebook's umask, resource limits and CPU affinity as they are at launch (a fresh
    interpreter would inherit them; this process has the server's). Best effort: a limit above
    the server's hard one cannot be raised without privilege."""
    import resource  # POSIX only, as the server is

    os.umask(int(state.get("umask", 0o022)))
    for name, (soft, hard) in state.get("rlimits", {}).items():
        try:
            resource.setrlimit(getattr(resource, name), (soft, hard))
        except (AttributeError, ValueError, OSError):
            pass
    if state.get("affinity") and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, state["affinity"])
        except OSError:
            pass


def _reseed() -> None:
    """A fresh interpreter seeds torch's and NumPy's global generators from the OS; forked, every
    worker (and every run) would draw the server's numbers. Python's ``random`` reseeds itself."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # CUDA's generators too, once CUDA is initialised in this worker
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    tempfile.tempdir = None  # found again from the environment this worker gets (TMPDIR)


class _Reaper:
    """The server's reaper: a process that SIGKILLs the process groups of the server's workers
    not yet collected once the server is gone. Forked at the server's start, while it is still
    bare (a cheap fork); forked again, with the groups it must know, should it die."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.groups: set[int] = set()  # the workers forked and not collected: their groups
        self.pid, self.fd = self._start()

    def _start(self) -> tuple[int, int]:
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:
            _reap(read_fd)
        os.close(read_fd)
        _send(self.sock, {REAPER: pid})  # a process the notebook keeps, as it keeps the server
        for group in self.groups:
            self._say(write_fd, group)
        return pid, write_fd

    def add(self, group: int) -> None:
        self.groups.add(group)
        self._say(self.fd, group)

    def drop(self, group: int) -> None:
        """The worker was collected: its pid, the group's id, may be used again."""
        self.groups.discard(group)
        self._say(self.fd, -group)

    def check(self) -> None:
        """Fork it again if it died (killed by hand): the workers must not lose it unseen."""
        try:
            ended = os.waitpid(self.pid, os.WNOHANG)[0] != 0
        except ChildProcessError:
            ended = True
        if ended:
            os.close(self.fd)
            self.pid, self.fd = self._start()

    def close(self) -> None:
        """The server ends: the reaper ends the groups left (none, once every worker was
        collected) and is collected here, not left for init."""
        os.close(self.fd)
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass

    @staticmethod
    def _say(fd: int, group: int) -> None:
        try:
            os.write(fd, f"{group}\n".encode())
        except OSError:  # it died: ``check`` forks it again and tells it every group
            pass


def _reap(read_fd: int) -> None:
    """The reaper's life, in the forked child: ``PID\\n`` adds a worker's group, ``-PID\\n``
    drops it; once the pipe closes (the server exited or died), SIGKILL the groups it holds."""
    try:
        # Signals sent to the server's group must not end it before the groups it holds.
        signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
        set_name(b"ddp-reaper")
        os.closerange(0, read_fd)  # nothing of the server's kept open (its socket's EOF tells the notebook)
        os.closerange(read_fd + 1, 1 << 16)
        groups: set[int] = set()
        pending = b""
        while True:
            data = os.read(read_fd, 4096)
            if not data:
                break
            *lines, pending = (pending + data).split(b"\n")
            for line in lines:
                group = int(line)
                if group > 0:
                    groups.add(group)
                else:
                    groups.discard(-group)
        for group in groups:
            try:
                os.killpg(group, signal.SIGKILL)
            except OSError:
                pass
    finally:
        os._exit(0)


def _end_group(pid: int) -> None:
    """SIGKILL what is left in the process group of worker ``pid``, which has exited (its pid,
    the group's id, is held until it is reaped)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


class _WorkerMain:
    """The worker's module (``process``), compiled once by the server: each forked worker runs it
    as ``__main__``, as ``runpy`` would, without reading or compiling it again (where no bytecode
    is written, ``PYTHONDONTWRITEBYTECODE``, that was 2-3 ms of every worker's start)."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec(MODULE)
        if spec is None or spec.loader is None or spec.origin is None:
            raise ImportError(f"{MODULE} cannot be found")
        self.spec, self.origin = spec, spec.origin
        self.code = spec.loader.get_code(MODULE)  # type: ignore[attr-defined]

    def run(self) -> None:
        main = types.ModuleType("__main__")
        vars(main).update(__file__=self.origin, __spec__=self.spec, __loader__=self.spec.loader,
                          __package__=self.spec.parent, __builtins__=builtins, __cached__=self.spec.cached)
        sys.modules["__main__"] = main
        sys.argv[0] = self.origin
        exec(self.code, vars(main))


def _become_worker(fds: list[int], server: int, close: tuple[int, ...], state: dict[str, Any],
                   worker_main: _WorkerMain) -> None:
    """In the forked child: a fresh session, the given pipes as its own, tied to the server, the
    notebook's process state, then the worker's ``main``. Never returns into the server's loop."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd in close:
            os.close(fd)
        os.setsid()  # its own process group: the supervisor's signals reach it and what it starts
        event_fd, control_fd, out_fd, err_fd = fds
        null = os.open(os.devnull, os.O_RDONLY)
        for source, target in ((null, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(source, target)
            os.close(source)
        set_name(b"ddp-worker")
        tie_to_parent(server, watch=False)  # the server ends the worker's group (``_end_group``)
        _take_process_state(state)
        _reseed()
        os.environ[BOOT_ENV] = json.dumps({"event_fd": event_fd, "control_fd": control_fd, "pooled": True})
        worker_main.run()
    finally:
        os._exit(EXIT_FAILED)


def _serve(sock: socket.socket, set_by_imports: dict[str, str], reaper: _Reaper, worker_main: _WorkerMain) -> None:
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that SIGCHLD writes to wake_w
    running: set[int] = set()  # forked, exit not reported yet
    _send(sock, {READY: os.getpid(), "threads": threading.active_count(), "set_by_imports": set_by_imports,
                 "os_threads": len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None})
    listen = sock.fileno()
    while True:
        ready = select.select([listen, wake_r], [], [])[0]
        if wake_r in ready:
            try:
                while os.read(wake_r, 512):
                    pass
            except BlockingIOError:
                pass
        reaper.check()
        for pid in sorted(running):
            rc = _exit_status(pid)
            if rc is not None:
                running.discard(pid)
                _end_group(pid)
                _send(sock, {EXITED: pid, "rc": rc})
        if listen not in ready:
            continue
        message, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 8)
        if not message:
            return  # the notebook closed the server (it does once no worker of it is running)
        request = json.loads(message)
        if request["op"] == "reap":
            pid = int(request["pid"])
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass
            reaper.drop(pid)
            continue
        try:
            if len(fds) != 4:
                raise ValueError(f"a fork request carries 4 descriptors, not {len(fds)}")
            sys.stdout.flush()
            sys.stderr.flush()
            server = os.getpid()
            pid = os.fork()
            if pid == 0:
                _become_worker(fds, server, (sock.fileno(), wake_r, wake_w, reaper.fd), request.get("state", {}),
                               worker_main)
            running.add(pid)
            reaper.add(pid)
            _send(sock, {FORKED: request["id"], "pid": pid})
        except Exception as exc:  # noqa: BLE001 - the notebook starts the rank another way
            _send(sock, {FAILED: request["id"], "error": f"{type(exc).__name__}: {exc}"})
        finally:
            for fd in fds:
                os.close(fd)


def main() -> None:
    boot = json.loads(os.environ.pop(BOOT_ENV))
    sock = socket.socket(fileno=boot["socket_fd"])
    reaper = _Reaper(sock)
    inherited = dict(os.environ)
    try:
        # What DDP imports on first use (torch._dynamo) included: a failed import can leave modules
        # half-imported, and forked workers would inherit that. The server does not start then; the
        # notebook starts fresh workers, which import only what each run needs.
        warm_up(True)
        # What a worker imports next, paid here once rather than in every rank.
        from . import channel, context, failure_event  # noqa: F401
        worker_main = _WorkerMain()
    except BaseException as exc:  # noqa: BLE001 - the notebook starts its workers cold, and says why
        _send(sock, {FAILED: None, "error": f"{type(exc).__name__}: {exc}"})
        os._exit(EXIT_FAILED)
    set_name(b"ddp-forkserver")
    # Every object so far out of the collector's reach: a forked worker's collections never touch
    # them, so their pages stay shared with the server instead of being copied in each worker.
    gc.freeze()
    # What the imports set themselves (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR): the notebook
    # gets the same when it imports them, which does not make this server stale.
    _serve(sock, {k: v for k, v in os.environ.items() if inherited.get(k) != v}, reaper, worker_main)
    reaper.close()
    os._exit(0)


if __name__ == "__main__":
    main()
