"""One worker OS process and its pipes: start, poll, signal, close.

Workers are never forks of the notebook: a notebook process may hold a CUDA context, and a forked
child of it cannot use CUDA. A worker is either forked by the fork server (``forkserver``: a clean
interpreter that imported torch and never touches CUDA) or a fresh interpreter started here
(``python .../worker/boot.py ddp_notebook.worker.process``); a ``ProcessHandle`` is what the
supervisor sees of either. Each worker leads its own process group so that terminating it also
ends anything it started (DataLoader workers), and is handed exactly two pipe ends: one to report
events, one to hear from the supervisor (whose EOF means the notebook is gone). On Linux the OS
also kills it when its parent dies (``worker.boot.tie_to_parent``), which is why every process started
here is started from the spawner thread.
"""
from __future__ import annotations

import fcntl
import json
import os
import select
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import IO, Optional, Protocol

from ...core.devices import Device
from ...core.events import RankConfig, encode, write_all
from ...worker import boot
from ...worker.boot import BOOT_ENV, MODULE
from .spawner import in_spawner_thread

__all__ = ["ProcessHandle", "SpawnedProcess", "WorkerProcess", "Prestarted", "spawn_process", "start_interpreter",
           "start_worker"]

_WRITE_POLL = 0.1  # seconds between two looks at a control pipe that is full
# The directory holding the ddp_notebook package: workers must import this very copy.
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


class ProcessHandle(Protocol):
    """What the supervisor needs of a worker process, whoever started it (after ``Popen``)."""

    pid: int
    stdout: IO[bytes]
    stderr: IO[bytes]
    lost: Optional[str]  # set when it died because the process that started it did (the fork server)

    def poll(self) -> Optional[int]:
        """The exit status once collected (``Popen``'s: -N for signal N), else None."""

    def ended(self) -> bool:
        """Whether it has exited, without collecting it: the zombie keeps its pid (and process
        group id) from being reused until ``wait``."""

    def wait(self, timeout: Optional[float] = None) -> int:
        """Collect it (``subprocess.TimeoutExpired`` after ``timeout``); its exit status."""

    def kill(self) -> None:
        """SIGKILL it, unless it was collected."""


class SpawnedProcess:
    """A fresh interpreter started here: our child, a ``Popen``."""

    def __init__(self, popen: subprocess.Popen) -> None:
        assert popen.stdout is not None and popen.stderr is not None
        self.popen, self.pid, self.stdout, self.stderr = popen, popen.pid, popen.stdout, popen.stderr
        self.lost: Optional[str] = None

    def poll(self) -> Optional[int]:
        return self.popen.poll()

    def ended(self) -> bool:
        if self.popen.returncode is not None:
            return True
        try:
            return os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
        except ChildProcessError:
            return True  # collected elsewhere

    def wait(self, timeout: Optional[float] = None) -> int:
        return self.popen.wait(timeout)

    def kill(self) -> None:
        self.popen.kill()


@dataclass
class WorkerProcess:
    """A started worker: its process, the supervisor's ends of its pipes, and what we did to it."""

    rank: int
    device: Device
    proc: ProcessHandle
    event_fd: int  # read end: frames from the worker
    control_fd: Optional[int]  # write end: core.events.Control frames; closing it = lifeline cut
    pidfd: Optional[int]
    signalled: Optional[int] = None  # the first signal the supervisor sent, if any
    returncode: Optional[int] = None
    # Control bytes wait until the assignment frame, written from its own thread, has gone out.
    _assigned: threading.Event = field(default_factory=threading.Event)
    _held: bytearray = field(default_factory=bytearray)
    _frame_cut: bool = False
    _control_lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self) -> IO[bytes]:
        return self.proc.stdout

    @property
    def stderr(self) -> IO[bytes]:
        return self.proc.stderr

    def send_control(self, frame: bytes, give_up: Optional[Callable[[], bool]] = None) -> bool:
        """Write one whole frame (``core.events``) on the control pipe; False when the worker is
        gone, or when ``give_up()`` said so while the frame was on its way (the worker's lifeline
        reads at once; a stopped process does not): then the rest of the frame is never sent,
        and the pipe can carry nothing more that the worker could read whole."""
        with self._control_lock:
            if not self._assigned.is_set():
                self._held += frame  # a stop asked while the assignment is still being written
                return True
            return self._write_control(frame, give_up)

    def assignment_sent(self) -> None:
        with self._control_lock:
            self._assigned.set()
            if self._held:
                self._write_control(bytes(self._held))
                self._held.clear()

    def _write_control(self, data: bytes, give_up: Optional[Callable[[], bool]] = None) -> bool:
        if self.control_fd is None or self._frame_cut:
            return False
        view = memoryview(data)
        try:
            if give_up is None:
                write_all(self.control_fd, data)
                return True
            while view:
                if give_up():
                    self._frame_cut = True  # nothing after a cut frame could be read: stops come as signals
                    return False
                if select.select([], [self.control_fd], [], _WRITE_POLL)[1]:
                    view = view[os.write(self.control_fd, view[:select.PIPE_BUF]):]  # never blocks
        except OSError:  # already gone: its exit will be seen by the supervisor
            return False
        return True

    def signal_group(self, signum: int) -> None:
        """Signal the worker's whole process group (it and anything it started); nothing once it
        has been reaped (its pid, and so its group id, may belong to another process by then)."""
        if self.returncode is not None:
            return
        if self.signalled is None:
            self.signalled = signum
        try:
            os.killpg(self.proc.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass

    def ended(self) -> bool:
        return self.returncode is not None or self.proc.ended()

    def reap(self) -> int:
        """Collect the exit status of an exited worker, after ending its leftover children."""
        # The zombie still holds the pid, so the group id cannot have been reused yet; unless the
        # worker was lost with the fork server (then init collected it, and its group went with it).
        if self.proc.lost is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.returncode = self.proc.wait()
        return self.returncode

    def close(self) -> None:
        with self._control_lock:
            _close_fds(self.control_fd, self.pidfd)
            self.control_fd = self.pidfd = None

    def discard(self) -> None:
        """End a worker whose run could not start: kill, reap, close every pipe."""
        self.signal_group(signal.SIGKILL)
        self.reap()
        self.close()
        _close_fds(self.event_fd)
        self.stdout.close()
        self.stderr.close()


def _close_fds(*fds: Optional[int]) -> None:
    for fd in fds:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass


def pidfd_of(pid: int) -> Optional[int]:
    # A pidfd becomes readable the moment the process exits: exits are seen without polling.
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def send_assignment(control_fd: int, frame: bytes) -> Future[None]:
    """Write a worker's assignment (one frame: its ``RankConfig`` with the packed call) to its
    new control pipe: at once when the pipe takes it whole, else from a thread of its own (a
    worker reads only once it is there, forked or warm), through its own copy of the pipe's end
    (closing the worker's end meanwhile cannot redirect the write to a reused descriptor). The
    future is done once the frame is written, or the worker is gone."""
    sent: Future[None] = Future()

    def send(fd: int, own: bool) -> None:
        try:
            write_all(fd, frame)
        except OSError:  # it died (while waiting): its exit is seen and reported by the supervisor
            pass
        finally:
            if own:
                os.close(fd)
            sent.set_result(None)

    if len(frame) <= _pipe_room(control_fd):  # the usual case: it fits in the new, empty pipe at once
        send(control_fd, own=False)
    else:
        threading.Thread(target=send, args=(os.dup(control_fd), True), name="ddp-assign", daemon=True).start()
    return sent


def _pipe_room(fd: int) -> int:
    """The bytes a new pipe takes before a write to it blocks (Linux says; POSIX promises PIPE_BUF)."""
    try:
        return fcntl.fcntl(fd, getattr(fcntl, "F_GETPIPE_SZ", 1032))
    except OSError:
        return select.PIPE_BUF


@dataclass
class Prestarted:
    """A worker process that imports torch (or has it: forked) and waits for its assignment on the
    control pipe; ``assignment``: the assignment on its way already (sent with the fork request)."""

    proc: ProcessHandle
    event_fd: int
    control_fd: int
    pidfd: Optional[int]
    assignment: Optional[Future[None]] = None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def discard(self) -> None:
        """End the process and collect it: SIGKILL where its assignment may have reached it, else
        its control pipe closed (it exits on EOF)."""
        _close_fds(self.control_fd, self.event_fd, self.pidfd)
        if self.assignment is not None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc.stdout.close()
        self.proc.stderr.close()


# The first code a worker runs, as a script: ``python -m`` would run the package's __init__
# first (imports, before the worker is tied to the notebook) and put the working directory first
# on sys.path, where another copy of the package (a clone next to the notebook) would win.
_BOOT_SCRIPT = os.path.abspath(boot.__file__)


def start_interpreter(module: str, boot_info: dict[str, object], pass_fds: tuple[int, ...]) -> subprocess.Popen:
    """Start ``python .../worker/boot.py MODULE`` from the spawner thread, tied to this process:
    ``boot_info`` reaches it in ``BOOT_ENV``, ``pass_fds`` are the pipe ends it inherits; its
    stdout and stderr are pipes, non-blocking on our side. An interrupt of the caller never loses
    a started process."""
    env = dict(os.environ)
    env[BOOT_ENV] = json.dumps(boot_info)
    env["PYTHONUNBUFFERED"] = "1"
    # The worker must import this very copy of the package, wherever it was imported from.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_PARENT, env.get("PYTHONPATH", "")) if p)

    def start() -> subprocess.Popen:
        # The process checks that its parent is still this process once it is tied to it.
        return subprocess.Popen(
            [sys.executable, _BOOT_SCRIPT, module, str(os.getpid())],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            pass_fds=pass_fds, env=env, start_new_session=True,
        )

    def undo(popen: subprocess.Popen) -> None:
        popen.kill()
        popen.wait()
        for stream in (popen.stdout, popen.stderr):
            if stream is not None:
                stream.close()

    popen = in_spawner_thread(start, undo)
    assert popen.stdout is not None and popen.stderr is not None
    for fd in (popen.stdout.fileno(), popen.stderr.fileno()):
        os.set_blocking(fd, False)
    return popen


def spawn_process(pooled: bool = False) -> Prestarted:
    """Start a worker interpreter; it warms up (imports torch) and waits to be assigned a run.
    A ``pooled`` one also imports what DDP loads lazily, since it has time while idle."""
    event_r, event_w = os.pipe()
    control_r, control_w = os.pipe()
    try:
        popen = start_interpreter(MODULE, {"event_fd": event_w, "control_fd": control_r, "pooled": pooled},
                                  (event_w, control_r))
    except BaseException:
        _close_fds(event_r, event_w, control_r, control_w)
        raise
    os.close(event_w)
    os.close(control_r)
    os.set_blocking(event_r, False)
    return Prestarted(proc=SpawnedProcess(popen), event_fd=event_r, control_fd=control_w, pidfd=pidfd_of(popen.pid))


def assignment(config: RankConfig, payload: bytes) -> bytes:
    """A rank's assignment as its worker reads it: ``config`` as one frame on the control pipe,
    with the packed call (``payload``) attached: no file holds it."""
    return encode(dict(config), payload)


def start_worker(rank: int, device: Device, frame: bytes, process: Optional[Prestarted] = None) -> WorkerProcess:
    """Assign rank ``rank`` of a run to a worker process (forked, or a fresh interpreter started
    now): ``frame`` is its ``assignment``, sent now unless it is on its way already."""
    process = process or spawn_process()
    worker = WorkerProcess(rank=rank, device=device, proc=process.proc, event_fd=process.event_fd,
                           control_fd=process.control_fd, pidfd=process.pidfd)
    sent = process.assignment or send_assignment(process.control_fd, frame)
    sent.add_done_callback(lambda _: worker.assignment_sent())
    return worker
