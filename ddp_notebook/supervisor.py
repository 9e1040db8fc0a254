"""The supervisor: watches a run's worker processes and turns what it sees into events.

One thread per run multiplexes every worker's event pipe, stdout, stderr and exit (pidfd)
with a selector, so a death is seen the moment it happens. Failures become ``WorkerFailure``
records; on the first one every peer is terminated (TERM, then KILL after a grace period),
because peers blocked in a collective would otherwise wait out a 10-30 minute timeout.

Which failure is the cause: a worker that dies without reporting (a signal, ``os._exit``)
closes its pipes and sockets before any peer can notice, so by the time a peer's knock-on
error arrives the death is already visible. On the first failure the supervisor therefore
drains every pipe and looks at every process before choosing: silent deaths first, then the
earliest reported exception. Everything after the cause is marked as a consequence.
"""
from __future__ import annotations

import os
import select
import selectors
import signal
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional

from .failures import FailureKind, WorkerFailure, order_failures, signal_name
from .processes import WorkerProcess
from .stall import dump_stacks, stall_failures
from .wire import FrameDecoder

__all__ = ["Supervisor", "SupervisorOptions", "FailureRecorder"]

_PHASE_KIND = {"run": FailureKind.EXCEPTION, "unpickle": FailureKind.UNPICKLE, "init": FailureKind.INIT,
               "startup": FailureKind.INIT, "result": FailureKind.RESULT}
_CHUNK = 1 << 16


@dataclass
class SupervisorOptions:
    kill_grace: float = 3.0  # TERM → KILL
    stop_grace: float = 10.0  # cooperative stop → TERM
    stall_timeout: Optional[float] = None


class FailureRecorder:
    """Failure bookkeeping shared by the local and the engine supervisor: the first failure
    waits for every other that already happened (``_gather``), the cause is named
    (``order_failures``), each failure becomes an event, then the peers are stopped
    (``_stop_peers``). Later failures are consequences."""

    failures: list[WorkerFailure]
    root: Optional[WorkerFailure]
    _settling: Optional[list[WorkerFailure]]
    _stderr: dict[int, deque]
    _emit: Callable[[dict, Optional[bytes]], None]

    def _gather(self) -> None:
        raise NotImplementedError

    def _stop_peers(self) -> None:
        raise NotImplementedError

    def _fail(self, failure: WorkerFailure) -> None:
        if self._settling is not None:
            self._settling.append(failure)
            return
        if self.root is not None:
            failure.consequence = True
            self._record(failure)
            return
        self._settling = [failure]
        self._gather()
        found, self._settling = self._settling, None
        ordered = order_failures(found)
        self.root = ordered[0]
        for f in ordered:
            self._record(f)
        self._stop_peers()

    def _record_stall(self, found: list[WorkerFailure], stacks: dict[int, str], idle: float) -> None:
        """The stall watchdog's verdict (``stall_failures``; the first is the cause), with every
        running rank's stacks in the event log; then the peers are stopped."""
        self._emit({"kind": "stalled", "time": time.time(), "ranks": [f.rank for f in found], "idle": idle,
                    "stacks": {str(r): text for r, text in stacks.items()}}, None)
        self.root = found[0]
        for f in found:
            self._record(f)
        self._stop_peers()

    def _record(self, failure: WorkerFailure) -> None:
        failure.stderr_tail = list(self._stderr[failure.rank])
        self.failures.append(failure)
        self._emit({"kind": "failure", "time": time.time(), "rank": failure.rank,
                    "failure": failure.to_dict()}, None)


class Supervisor(FailureRecorder):
    """Watches a run's workers until every one has exited (``supervise()``, on the run's own
    thread); reports through ``emit(event, blob)``. ``request_stop`` may be called from any thread."""

    def __init__(self, workers: list[WorkerProcess], options: SupervisorOptions,
                 emit: Callable[[dict, Optional[bytes]], None]) -> None:
        self.workers = {w.rank: w for w in workers}
        self.options = options
        self._emit = emit
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, ("wake", -1))
        self._commands: list[tuple[str, float, str]] = []
        self._cmd_lock = threading.Lock()
        self._decoders = {r: FrameDecoder() for r in self.workers}
        self._partial: dict[tuple[int, str], bytes] = {}
        self._fds: dict[tuple[int, str], int] = {}
        self.reported: dict[int, str] = {}
        self.ready: set[int] = set()
        self.main_ident: dict[int, int] = {}
        self.steps: dict[int, Optional[int]] = {}
        self.failures: list[WorkerFailure] = []
        self.root: Optional[WorkerFailure] = None
        self.result_blob: Optional[bytes] = None
        self.stop_reason: Optional[str] = None
        self._stop_deadline: Optional[float] = None
        self._kill_deadline: dict[int, float] = {}
        self._released = False
        self._settling: Optional[list[WorkerFailure]] = None
        self._last_progress: Optional[float] = None
        self._exited: set[int] = set()
        self._stderr: dict[int, deque] = {r: deque(maxlen=40) for r in self.workers}
        for w in workers:
            out, err = w.popen.stdout.fileno(), w.popen.stderr.fileno()  # type: ignore[union-attr]
            for name, fd in (("event", w.event_fd), ("stdout", out), ("stderr", err)):
                self._fds[(w.rank, name)] = fd
                self.sel.register(fd, selectors.EVENT_READ, (name, w.rank))
            if w.pidfd is not None:
                self.sel.register(w.pidfd, selectors.EVENT_READ, ("exit", w.rank))

    def abandon(self) -> None:
        """The notebook process is leaving: kill every worker now."""
        for w in self.workers.values():
            w.signal_group(signal.SIGKILL)

    # ---- requests from other threads -------------------------------------------------
    def request_stop(self, grace: float, reason: str) -> None:
        with self._cmd_lock:
            self._commands.append(("stop", grace, reason))
        try:
            os.write(self._wake_w, b"!")
        except OSError:
            pass

    # ---- main loop -----------------------------------------------------------------
    def supervise(self) -> None:
        try:
            while len(self._exited) < len(self.workers):
                ready = self.sel.select(self._timeout())
                # exits first: a death must be known before a peer's knock-on report is read
                for key, _ in sorted(ready, key=lambda kv: kv[0].data[0] != "exit"):
                    kind, rank = key.data
                    if kind == "wake":
                        self._on_wake()
                    elif kind == "exit":
                        self._on_exit(rank)
                    elif (rank, kind) in self._fds:
                        self._read(rank, kind)
                self._poll_exits()
                self._check_deadlines()
                self._check_stall()
            for rank, kind in list(self._fds):
                self._drain(rank, kind)
        except BaseException as exc:  # a bug here must never leave workers behind
            for w in self.workers.values():
                w.signal_group(signal.SIGKILL)
                w.reap()
            self._emit({"kind": "supervisor_error", "time": time.time(), "message": repr(exc)}, None)
        finally:
            for w in self.workers.values():
                w.close()
            for rank, kind in list(self._fds):
                self._close(rank, kind)
            self.sel.close()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _timeout(self) -> float:
        now = time.monotonic()
        deadlines = list(self._kill_deadline.values())
        if self._stop_deadline is not None:
            deadlines.append(self._stop_deadline)
        if self.options.stall_timeout and self._last_progress is not None:
            deadlines.append(self._last_progress + self.options.stall_timeout)
        wait = min((d - now for d in deadlines), default=1.0)
        if any(w.pidfd is None for w in self.workers.values()):
            wait = min(wait, 0.05)  # no pidfd: exits are found by polling
        return max(0.0, min(wait, 1.0))

    # ---- reading ---------------------------------------------------------------------
    def _read(self, rank: int, kind: str) -> None:
        """Read what one pipe has; at EOF, close it."""
        fd = self._fds[(rank, kind)]
        try:
            data = os.read(fd, _CHUNK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._close(rank, kind)
            if kind != "event":
                self._output(rank, kind, b"", final=True)
        elif kind == "event":
            for event, blob in self._decoders[rank].feed(data):
                self._on_worker_event(rank, event, blob)
        else:
            self._output(rank, kind, data)

    def _close(self, rank: int, kind: str) -> None:
        """Close one pipe through its owner (Popen's file objects would close a reused fd later)."""
        fd = self._fds.pop((rank, kind))
        self.sel.unregister(fd)
        w = self.workers[rank]
        if kind == "event":
            os.close(fd)
        else:
            getattr(w.popen, kind).close()

    def _drain(self, rank: int, kind: str) -> None:
        while (rank, kind) in self._fds:
            fd = self._fds[(rank, kind)]
            if not select.select([fd], [], [], 0)[0]:
                return
            self._read(rank, kind)

    def _output(self, rank: int, stream: str, data: bytes, final: bool = False) -> None:
        buf = self._partial.pop((rank, stream), b"") + data
        if not final and b"\n" in buf and len(buf) < _CHUNK:
            cut = buf.rindex(b"\n") + 1
            buf, rest = buf[:cut], buf[cut:]
            if rest:
                self._partial[(rank, stream)] = rest
        elif not final and len(buf) < _CHUNK:
            self._partial[(rank, stream)] = buf
            return
        if buf:
            text = buf.decode("utf-8", errors="replace")
            if stream == "stderr":
                self._stderr[rank].extend(text.splitlines())
            self._emit({"kind": "output", "time": time.time(), "rank": rank, "stream": stream, "text": text}, None)

    def _on_worker_event(self, rank: int, event: dict, blob: Optional[bytes]) -> None:
        event["rank"] = rank
        event.pop("blob", None)
        kind = event.get("kind")
        if kind == "started" and "main_thread" in event:
            self.main_ident[rank] = event["main_thread"]
        elif kind == "ready":
            self.ready.add(rank)
        elif kind == "progress":
            self._last_progress = time.monotonic()
            if event.get("step") is not None:
                self.steps[rank] = event["step"]
        elif kind == "done":
            self.reported[rank] = "done"
            if rank == 0:
                self.result_blob = blob
        elif kind == "error":
            self.reported[rank] = "error"
        self._emit(event, None)
        if kind == "error":
            w = self.workers[rank]
            self._fail(WorkerFailure(
                rank=rank, device=str(w.device), kind=_PHASE_KIND.get(event.get("phase", "run"), "exception"),
                time=event.get("time", time.time()), pid=w.pid, phase=event.get("phase", "run"),
                exc_type=event.get("exc_type"), message=event.get("message", ""),
                traceback=event.get("traceback", ""), last_step=self.steps.get(rank)))
        elif kind == "done":
            self._maybe_release()

    # ---- exits -----------------------------------------------------------------------
    def _poll_exits(self) -> None:
        for rank, w in self.workers.items():
            if rank in self._exited:
                continue
            try:
                info = os.waitid(os.P_PID, w.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                info = True  # already reaped
            if info is not None:
                self._on_exit(rank)

    def _on_exit(self, rank: int) -> None:
        if rank in self._exited:
            return
        self._exited.add(rank)
        w = self.workers[rank]
        if w.pidfd is not None:
            self.sel.unregister(w.pidfd)
        for kind in ("event", "stdout", "stderr"):
            self._drain(rank, kind)  # whatever it wrote before dying
        rc = w.reap()
        self._kill_deadline.pop(rank, None)
        sig = signal_name(-rc) if rc < 0 else None
        by_us = w.signalled is not None and rank not in self.reported
        self._emit({"kind": "exited", "time": time.time(), "rank": rank, "pid": w.pid, "exit_code": rc,
                    "signal": sig, "by_supervisor": by_us}, None)
        if rank in self.reported or by_us:
            return
        self._fail(WorkerFailure(
            rank=rank, device=str(w.device), kind=FailureKind.SIGNAL if rc < 0 else FailureKind.EXIT,
            time=time.time(), pid=w.pid, phase="run" if rank in self.ready else "startup",
            exit_code=rc, signal=sig, last_step=self.steps.get(rank)))

    # ---- failures and stopping -------------------------------------------------------------
    def _gather(self) -> None:
        """Make every death and report that already happened visible before the cause is named."""
        for rank, kind in list(self._fds):
            self._drain(rank, kind)
        self._await_dying()
        self._poll_exits()

    def _stop_peers(self) -> None:
        self._terminate_alive()

    def _await_dying(self) -> None:
        """Wait (briefly) for the exit status of workers whose event pipe closed without a report.

        A dying process closes its pipes (and its sockets, which is what its peers notice) before
        it becomes a zombie; tearing down a large address space can take that long. Its exit is
        certain, and needed to blame it rather than the peer that noticed."""
        for rank, w in self.workers.items():
            if rank in self._exited or rank in self.reported or (rank, "event") in self._fds:
                continue
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                if w.pidfd is not None:
                    if select.select([w.pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                        break
                elif os.waitid(os.P_PID, w.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                    break
                else:
                    time.sleep(0.005)
            self._poll_exits()

    def _terminate_alive(self) -> None:
        deadline = time.monotonic() + self.options.kill_grace
        for rank, w in self.workers.items():
            if rank in self._exited:
                continue
            if self.reported.get(rank) != "error":  # a reporting worker is already leaving
                w.signal_group(signal.SIGTERM)
            self._kill_deadline[rank] = deadline

    def _maybe_release(self) -> None:
        if not self._released and self.root is None and all(
                self.reported.get(r) == "done" for r in self.workers):
            self._released = True
            for w in self.workers.values():
                w.send_control(b"x")

    def _on_wake(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass
        with self._cmd_lock:
            commands, self._commands = self._commands, []
        for name, grace, reason in commands:
            if name == "stop" and self.stop_reason is None and self.root is None and not self._released:
                self.stop_reason = reason
                self._emit({"kind": "stopping", "time": time.time(), "reason": reason}, None)
                for rank, w in self.workers.items():
                    if rank not in self._exited:
                        w.send_control(b"s")
                self._stop_deadline = time.monotonic() + grace

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self._stop_deadline = None
            if not self._released:
                for rank, w in self.workers.items():
                    if self.reported.get(rank) == "done":
                        w.send_control(b"x")
                self._terminate_alive()
        for rank, deadline in list(self._kill_deadline.items()):
            if now >= deadline and rank not in self._exited:
                self.workers[rank].signal_group(signal.SIGKILL)
                del self._kill_deadline[rank]

    # ---- stall watchdog ---------------------------------------------------------------
    def _check_stall(self) -> None:
        timeout = self.options.stall_timeout
        if (not timeout or self._last_progress is None or self.root is not None
                or self.stop_reason is not None or self._released):
            return
        idle = time.monotonic() - self._last_progress
        if idle < timeout:
            return
        alive = [r for r in self.workers if r not in self._exited and r not in self.reported]
        if not alive:
            return

        def request() -> None:
            for r in alive:
                try:
                    os.kill(self.workers[r].pid, signal.SIGUSR1)
                except ProcessLookupError:
                    pass

        stacks = dump_stacks({r: self.workers[r].stack_file for r in alive}, request)
        found = stall_failures(stacks, self.main_ident, self.steps, idle,
                               {r: str(self.workers[r].device) for r in alive}, {r: self.workers[r].pid for r in alive})
        self._record_stall(found, stacks, idle)
