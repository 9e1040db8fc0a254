"""The fork server, seen from the notebook: workers forked in milliseconds, CUDA-safely.

A run's workers are forked by a server process (``worker/zygote.py``) that imported torch once and
never touches CUDA, so running a cell again costs a fork per rank, not an interpreter and
``import torch`` per rank. Every run still gets brand-new processes. The server starts on the
first launch (``%load_ext ddp_notebook`` starts it at once), lives as long as the notebook
process, and is replaced when a variable that torch reads at import changes in the notebook
(``TORCH_*``, ``CUDA_*``, ``OMP_*``...: see ``READ_AT_IMPORT``); every other variable, the working
directory and ``sys.path`` reach each worker at launch, with its assignment.

A launch never waits for the server: it asks for its workers (``request_workers``) and the run's
own thread collects them (``ForkRequest.poll``), so a server still importing torch (the first
launch without ``%load_ext``) only delays the ranks, which the panel says. A server that cannot
answer (stopped by a debugger or ``SIGSTOP``, wedged, dead) is given up on: that run starts fresh
interpreters, the next launch a new server, and the one given up on is ended once none of its
workers runs.

Linux only (it relies on ``PR_SET_PDEATHSIG`` to end everything with the notebook). Elsewhere,
after ``disable()``, or with ``DDP_NOTEBOOK_FORKSERVER=0`` in the environment, workers are fresh
interpreters.

>>> from ddp_notebook.executors.local import forkserver
>>> forkserver.start()         # doctest: +SKIP
>>> forkserver.status()        # doctest: +SKIP
{'enabled': True, 'used': True, 'running': True, 'ready': True, 'pid': 4242, 'error': None, 'threads': 2,
 'reaper': 4243}
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import select
import signal
import socket
import sys
import threading
import time
from concurrent.futures import Future
from typing import Any, Optional

import psutil

from ...core.errors import LaunchOptionError
from ...worker.boot import EXITED, FAILED, FORKED, READY, REAPER, ZYGOTE_MODULE
from ..base import signal_name
from .forked import READ_AT_IMPORT, ForkedProcess, process_state, staleness
from .processes import Prestarted, pidfd_of, send_assignment, start_interpreter

__all__ = ["ForkedProcess", "ForkRequest", "READ_AT_IMPORT", "Unavailable", "enable", "disable", "start", "stop",
           "status", "supported", "request_workers", "importing"]

# How long a run waits for a server that is still importing torch (a busy machine takes long):
# forking from it then is still sooner than starting every rank's interpreter on the same cores.
START_TIMEOUT = 120.0
# A ready server answers a fork request in milliseconds; one that does not in this long (wedged) is
# given up on: the run starts fresh interpreters and the next launch a new server. A stopped one
# (SIGSTOP, a debugger) is given up on at once.
FORK_TIMEOUT = 15.0
_ENV_SWITCH = "DDP_NOTEBOOK_FORKSERVER"
_TAIL = 8192  # what is kept of the server's own stderr, to say why it failed


class Unavailable(Exception):
    """The server cannot fork now (it failed to start, or died): the run starts cold workers."""


class _Server:
    """One fork server process, and the thread that reads what it sends."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self.key = staleness()
        self.set_by_imports: dict[str, str] = {}  # variables its imports set: the notebook's imports set them too
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.popen = start_interpreter(ZYGOTE_MODULE, {"socket_fd": theirs.fileno()}, (theirs.fileno(),))
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        self.threads: Optional[int] = None
        self.reaper: Optional[int] = None  # the pid of the server's reaper (``worker.zygote``)
        self.error: Optional[str] = None
        self.ready = threading.Event()  # set once it can fork, or once it never will
        self.ready_at: Optional[float] = None  # (monotonic) when it could fork
        self.dead = False
        self.unresponsive = False  # given up on while alive (stopped, wedged): ended, not closed
        self.started_ok = False  # it said it was ready (an error later is not a failure to start)
        self.retiring = False
        self._lock = threading.Lock()
        self._send_lock = threading.Lock()
        self._next = 0
        self._pending: dict[int, tuple[Future[ForkedProcess], int, int]] = {}
        self._procs: dict[int, ForkedProcess] = {}
        self._stderr = b""
        threading.Thread(target=self._read, name="ddp-forkserver", daemon=True).start()

    # ---- requests ---------------------------------------------------------------------------------
    def request(self, state: dict[str, Any]) -> _Pending:
        """Ask for a new worker; never waits for the answer (see ``ForkRequest``). A server still
        importing torch finds the request when it is ready. Raises ``Unavailable`` when it is gone."""
        if self.dead or self.error is not None:
            raise Unavailable(self.error or "the fork server is gone")
        pipes = [os.pipe() for _ in range(4)]  # event, control, stdout, stderr
        (event_r, event_w), (control_r, control_w), (out_r, out_w), (err_r, err_w) = pipes
        future: Future[ForkedProcess] = Future()
        with self._lock:
            request, self._next = self._next, self._next + 1
            self._pending[request] = (future, out_r, err_r)
        try:
            with self._send_lock:
                socket.send_fds(self.sock, [json.dumps({"op": "fork", "id": request, "state": state}).encode()],
                                [event_w, control_r, out_w, err_w])
        except OSError as exc:
            with self._lock:
                self._pending.pop(request, None)
            for fd in (event_r, control_w, out_r, err_r):
                os.close(fd)
            raise Unavailable(f"the fork server is gone ({exc})") from None
        finally:
            for fd in (event_w, control_r, out_w, err_w):  # the server has its own copies now
                os.close(fd)
        return _Pending(future, event_r, control_w)

    def cannot_answer(self, asked_at: float) -> Optional[str]:
        """Why requests made at ``asked_at`` (monotonic) will get no answer, or None while one may
        still come."""
        if self.dead or self.error is not None:
            return self.error or "the fork server is gone"
        now = time.monotonic()
        try:
            stopped = psutil.Process(self.popen.pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
        except psutil.Error:
            stopped = False  # gone: the reader thread is about to say so
        if stopped:
            return f"the fork server (pid {self.popen.pid}) is stopped (SIGSTOP, or a debugger) and cannot fork"
        if self.ready_at is None:
            if now - asked_at > START_TIMEOUT:
                return f"the fork server did not finish importing torch in {START_TIMEOUT:.0f} s"
            return None
        if now - max(asked_at, self.ready_at) > FORK_TIMEOUT:
            return f"the fork server (pid {self.popen.pid}) did not answer in {FORK_TIMEOUT:.0f} s"
        return None

    def give_up(self, why: str) -> None:
        """Stop waiting for a server that cannot answer: its pending requests fail, and it is
        retired (ended once none of its workers runs: SIGKILL, since it reads nothing)."""
        with self._lock:
            # (one that could not start, or exited, is not unresponsive: starting it again would fail the same way)
            self.unresponsive = self.unresponsive or not (self.dead or self.error is not None)
            self.error = self.error or why
            pending, self._pending = list(self._pending.values()), {}
        for future, out_fd, err_fd in pending:
            os.close(out_fd)
            os.close(err_fd)
            if not future.done():
                future.set_exception(Unavailable(why))
        self.retire()

    def reap(self, pid: int) -> None:
        with self._lock:
            self._procs.pop(pid, None)
            close = self.retiring and not self._procs and not self._pending
        self._send({"op": "reap", "pid": pid})
        if close:
            self._close()

    def retire(self) -> None:
        """End the server once no worker of it is running (its workers die with it)."""
        with self._lock:
            self.retiring = True
            close = not self._procs and not self._pending
        if close:
            self._close()

    def _send(self, message: dict[str, Any]) -> None:
        try:
            with self._send_lock:
                self.sock.send(json.dumps(message).encode())
        except OSError:  # gone: the reader has seen, or will see, its end
            pass

    def _close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # EOF for the server; the reader then collects it
        except OSError:
            pass
        # It reads no EOF while stopped or wedged, nor while it imports torch (seconds, for
        # nothing: it has forked no worker yet): ended for good.
        if self.unresponsive or not (self.ready.is_set() or self.dead):
            try:
                os.kill(self.popen.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # ---- what it says -----------------------------------------------------------------------------
    def _read(self) -> None:
        assert self.popen.stderr is not None and self.popen.stdout is not None
        streams = [self.popen.stdout.fileno(), self.popen.stderr.fileno()]
        sock = self.sock.fileno()
        while True:
            ready = select.select([sock, *streams], [], [])[0]
            for fd in streams[:]:
                if fd in ready:
                    data = _read_some(fd)
                    if data == b"":
                        streams.remove(fd)
                    elif data and fd == self.popen.stderr.fileno():
                        self._stderr = (self._stderr + data)[-_TAIL:]
            if sock in ready:
                try:
                    message = self.sock.recv(1 << 16)
                except ConnectionResetError:
                    # The server exited with a request of ours unread: Linux reports that first,
                    # then what the server sent before it went (why it could not start) is read.
                    continue
                except OSError:
                    message = b""
                if not message:
                    break
                self._dispatch(json.loads(message))
        self._died()

    def _dispatch(self, message: dict[str, Any]) -> None:
        if REAPER in message:
            self.reaper = int(message[REAPER])
        elif READY in message:
            self.threads = message.get("os_threads")
            self.set_by_imports = dict(message.get("set_by_imports") or {})
            self.started_ok = True
            self.ready_at = time.monotonic()
            self.ready.set()
        elif FORKED in message or FAILED in message:
            key = message.get(FORKED, message.get(FAILED))
            with self._lock:
                pending = self._pending.pop(key, None) if key is not None else None
                if pending is not None and FORKED in message:
                    proc = self._procs[message["pid"]] = ForkedProcess(self.reap, message["pid"], pending[1],
                                                                       pending[2], self.popen.pid)
            if pending is None:
                if key is None and FAILED in message:  # the server could not start at all
                    self.error = f"the fork server could not start: {message.get('error')}"
                    self.ready.set()
                # else: an answer to a request given up on; its worker leaves at EOF on its pipes
            elif FORKED in message:
                pending[0].set_result(proc)
            else:
                os.close(pending[1])
                os.close(pending[2])
                pending[0].set_exception(Unavailable(f"the fork server could not fork: {message.get('error')}"))
        elif EXITED in message:
            with self._lock:
                found = self._procs.get(message[EXITED])
            if found is not None:
                found.exited(int(message["rc"]))

    def _died(self) -> None:
        """The server exited: its workers died with it (Linux kills them)."""
        rc = self.popen.wait()
        with self._lock:
            self.dead = True
            pending, self._pending = list(self._pending.values()), {}
            procs = list(self._procs.values())
        if not self.ready.is_set() or (self.error is None and not self.retiring):
            why = f"signal {-rc}" if rc < 0 else f"status {rc}"
            tail = self._stderr.decode(errors="replace").strip()
            self.error = self.error or f"the fork server exited ({why})" + (f": {tail[-2000:]}" if tail else "")
        self.ready.set()
        for future, out_fd, err_fd in pending:
            os.close(out_fd)
            os.close(err_fd)
            future.set_exception(Unavailable(self.error or "the fork server is gone"))
        death = signal_name(-rc) if rc < 0 else f"status {rc}"
        for proc in procs:
            if not proc.reported():  # an exit reported before the server's death stays the worker's
                _await_death(proc.pid)
                proc.exited(-signal.SIGKILL, lost=f"the fork server (pid {self.popen.pid}) that started it ended "
                                                  f"({death})")
        self.sock.close()
        for stream in (self.popen.stdout, self.popen.stderr):
            if stream is not None:
                stream.close()


def _await_death(pid: int, timeout: float = 10.0) -> None:
    """Wait until a worker of a dead server has exited (Linux killed it with the server, but a large
    process takes a moment to go): its run must not end while it is still there."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already (or no pidfd here: nothing better than its death signal)
        return
    try:
        select.select([fd], [], [], timeout)
    finally:
        os.close(fd)


def _read_some(fd: int) -> Optional[bytes]:
    """What a pipe has (b"" at EOF), None when nothing is there after all."""
    try:
        return os.read(fd, 1 << 16)
    except BlockingIOError:
        return None
    except OSError:
        return b""


def _collect_when_done(future: Future[ForkedProcess]) -> None:
    """A worker forked for a request given up on: killed (it may hold its assignment, and would
    start its rank), collected, its output closed."""
    if not future.cancelled() and future.exception() is None:
        proc = future.result()

        def collect() -> None:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()

        threading.Thread(target=collect, name="ddp-forkserver-collect", daemon=True).start()


class _Pending:
    """One fork request on its way: the notebook's ends of the worker's event and control pipes,
    and the server's answer to come."""

    def __init__(self, future: Future[ForkedProcess], event_fd: int, control_fd: int) -> None:
        self.future = future
        self.event_fd, self.control_fd = event_fd, control_fd
        self.assignment: Optional[Future[None]] = None  # its assignment on its way

    def worker(self) -> Prestarted:
        """The forked worker, once answered (raises ``Unavailable`` when the fork failed)."""
        proc = self.future.result(0)
        os.set_blocking(self.event_fd, False)
        os.set_blocking(proc.stdout.fileno(), False)
        os.set_blocking(proc.stderr.fileno(), False)
        return Prestarted(proc=proc, event_fd=self.event_fd, control_fd=self.control_fd, pidfd=pidfd_of(proc.pid),
                          assignment=self.assignment)

    def give_up(self) -> None:
        """A worker forked anyway is killed (its assignment may have reached it) and collected."""
        os.close(self.event_fd)
        os.close(self.control_fd)
        self.future.add_done_callback(_collect_when_done)


class ForkRequest:
    """``n`` workers asked of the fork server, collected without ever blocking: ``poll`` says
    whether they are there yet (a ready server answers in milliseconds, one still importing torch
    once it is ready) and raises ``Unavailable`` once the server cannot answer. ``cancel`` lets go
    of whatever was asked for."""

    def __init__(self, server: _Server, assignments: list[bytes]) -> None:
        self._server = server
        self._asked_at = time.monotonic()
        state = process_state()  # the notebook's umask, limits and affinity as they are at launch
        self._pending: list[_Pending] = []
        try:
            for frame in assignments:
                pending = server.request(state)
                self._pending.append(pending)
                pending.assignment = send_assignment(pending.control_fd, frame)
        except BaseException:
            self.cancel()
            raise

    def importing(self) -> bool:
        """Whether the server is still importing torch (the ranks wait for it)."""
        return not self._server.ready.is_set()

    def poll(self, timeout: float) -> Optional[list[Prestarted]]:
        """The workers once every one is forked (waiting up to ``timeout`` s for the answers), else
        None; ``Unavailable`` (everything asked for let go) when they will not come."""
        concurrent.futures.wait([p.future for p in self._pending], timeout=timeout)
        if all(p.future.done() for p in self._pending):
            workers: list[Prestarted] = []
            try:
                for pending in self._pending:
                    workers.append(pending.worker())
            except BaseException:
                for worker in workers:
                    worker.discard()
                for pending in self._pending[len(workers):]:
                    pending.give_up()
                self._pending = []
                raise
            self._pending = []
            return workers
        why = self._server.cannot_answer(self._asked_at)
        if why is None:
            return None
        self.cancel()
        self._server.give_up(why)
        raise Unavailable(why)

    def cancel(self) -> None:
        pending, self._pending = self._pending, []
        for p in pending:
            p.give_up()


def supported() -> bool:
    """Whether workers can be forked by a server here (Linux, with descriptor passing)."""
    return sys.platform.startswith("linux") and hasattr(socket, "send_fds") and hasattr(os, "fork")


_lock = threading.Lock()
_enabled = supported() and os.environ.get(_ENV_SWITCH, "1") != "0"
_server: Optional[_Server] = None
_failed: Optional[_Server] = None  # the last server that could not start, kept for its error and key


def _current() -> Optional[_Server]:
    """The server launches use now, started if needed, or replaced when it is stale (a variable of
    ``READ_AT_IMPORT`` or the installed packages changed), dead or unresponsive. None when it is
    disabled, or when it failed to start with what the notebook has now (launches start cold
    workers until something changes, or ``start()`` tries again)."""
    global _server, _failed
    with _lock:
        if not _enabled:
            return None
        server = _server
        if server is not None and server.owner != os.getpid():
            server = _server = None  # a forked copy of the notebook process: its own server
        key = staleness(server.set_by_imports if server is not None else None)
        if server is not None and (server.dead or server.error is not None or server.key != key):
            if server.error is not None and not server.started_ok and not server.unresponsive and server.key == key:
                _failed = server  # it could not start: starting it again the same way would not help
            server.retire()
            server = _server = None
        if server is None:
            if _failed is not None and _failed.key == key and _failed.owner == os.getpid():
                return None
            server, _server, _failed = _Server(), None, None
            _server = server
        return server


def importing() -> bool:
    """Whether the fork server is enabled and still importing torch (started now if it was not):
    a run's ranks then start once it is ready."""
    server = _current()
    return server is not None and not server.ready.is_set()


def start() -> None:
    """Start the fork server now, in the background (it imports torch): the next launch forks at
    once. Nothing happens when it runs already or is disabled; one that failed to start is tried
    again."""
    global _failed
    with _lock:
        _failed = None
    _current()


def request_workers(assignments: list[bytes]) -> Optional[ForkRequest]:
    """Ask the fork server for a new worker per assignment (``ForkRequest``: never blocks), each
    sent its assignment at once (it reads it once forked); None when the server is disabled or
    cannot fork (the caller then starts fresh interpreters)."""
    server = _current()
    if server is None:
        return None
    try:
        return ForkRequest(server, assignments)
    except Unavailable:
        return None


def stop() -> None:
    """End the fork server once no worker of it runs; the next launch starts a new one."""
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None and server.owner == os.getpid():
        server.retire()


def enable() -> None:
    """Fork workers from the server (the default where it is supported)."""
    global _enabled
    if not supported():
        raise LaunchOptionError("the fork server needs Linux: workers here are fresh interpreters")
    _enabled = True


def disable() -> None:
    """Start every worker as a fresh interpreter, and end the server."""
    global _enabled, _failed
    _enabled = False
    _failed = None
    stop()


def status() -> dict[str, object]:
    """``enabled``; ``used``: whether the next launch forks from it; ``running``, ``ready`` (done
    importing torch) and its ``pid``; the
    ``error`` that made launches start fresh workers instead; and ``threads``, the OS threads it
    held once ready to fork (its own, and the BLAS library's pool, which stops itself at a fork;
    None until ready); ``reaper``, the pid of the process that ends the groups of its workers
    should it die."""
    with _lock:
        server = _server if _server is not None and _server.owner == os.getpid() else None
        if server is None and _failed is not None and _failed.owner == os.getpid():
            server = _failed
    running = server is not None and not server.dead
    return {"enabled": _enabled, "used": _enabled, "running": running,
            "ready": running and server is not None and server.ready.is_set() and server.error is None,
            "pid": server.popen.pid if server else None, "error": server.error if server else None,
            "threads": server.threads if server else None, "reaper": server.reaper if server else None}
