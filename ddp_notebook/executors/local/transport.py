"""The local transport: a run's worker processes as the supervisor sees them.

Its first polls get the processes (``RankStarter``: forked, or fresh interpreters), so that
``launch`` never waits for them; a run interrupted before they exist starts none. Then one
selector multiplexes every worker's event pipe, stdout, stderr and exit (pidfd), so a death is
seen the moment it happens. Requests are a frame on a worker's control pipe (stop, release, a
session's request) or a
signal to its process group (TERM, KILL; STACK_SIGNAL to the worker for its stacks).
"""
from __future__ import annotations

import codecs
import os
import select
import selectors
import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, Protocol

import psutil

from ...core.events import Control, FrameDecoder, encode
from ...core.failures import FailureKind
from ...transfer.loading import Received
from ...worker.boot import STACK_SIGNAL
from ..base import Exited, Observation, Output, Transport, WorkerEvent, signal_name
from .processes import WorkerProcess

__all__ = ["LocalTransport", "Starter"]

_CHUNK = 1 << 16
_STREAMS = ("event", "stdout", "stderr")
_STOP, _FLUSH, _RELEASE = (encode({"kind": kind}) for kind in (Control.STOP, Control.FLUSH, Control.RELEASE))


def _cpu_with_children(pid: int) -> Optional[float]:
    """CPU seconds of a process and of its children, live and ended: a rank whose work runs in a
    multiprocessing Pool, DataLoader workers or a subprocess is busy, not frozen."""
    try:
        proc = psutil.Process(pid)
        times = proc.cpu_times()
        total = times.user + times.system + times.children_user + times.children_system
        for child in proc.children(recursive=True):
            try:
                child_times = child.cpu_times()
                total += child_times.user + child_times.system
            except psutil.Error:
                pass  # it ended meanwhile: counted in children_* once reaped
        return total
    except psutil.Error:
        return None


class Starter(Protocol):
    """How a transport gets its processes (``executor.RankStarter``)."""

    def poll(self, timeout: float) -> Optional[list[WorkerProcess]]:
        """The ranks' processes, started, once they can be (None meanwhile)."""

    def cancel(self) -> None:
        """Let go of what was asked for (the run ended before the processes came)."""


_ORDER = {"exit": 0, "stdout": 1, "stderr": 1}  # the order a poll reads what is ready in (events after)
_START_POLL = 0.1  # seconds: while the processes are on their way, the supervisor still hears requests


class LocalTransport(Transport):
    """Gets the worker processes of a run (one per rank), then watches them until each has exited
    and been reaped."""

    def __init__(self, starter: Starter, ranks: int) -> None:
        self._starter: Optional[Starter] = starter
        self._ranks = ranks
        self.workers: dict[int, WorkerProcess] = {}
        self.sel = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self.sel.register(self._wake_r, selectors.EVENT_READ, ("wake", -1))
        self._decoders: dict[int, FrameDecoder] = {}
        self._partial: dict[tuple[int, str], bytes] = {}
        self._text: dict[tuple[int, str], codecs.IncrementalDecoder] = {}
        self._fds: dict[tuple[int, str], int] = {}
        self._exited: set[int] = set()
        self._lock = threading.Lock()
        self._closed = False
        self._cancelled = False  # interrupted or abandoned before the processes existed: none starts

    def _attach(self, workers: Sequence[WorkerProcess]) -> None:
        for w in workers:
            self._decoders[w.rank] = FrameDecoder()
            for name, fd in (("event", w.event_fd), ("stdout", w.stdout.fileno()), ("stderr", w.stderr.fileno())):
                self._fds[(w.rank, name)] = fd
                self.sel.register(fd, selectors.EVENT_READ, (name, w.rank))
            if w.pidfd is not None:
                self.sel.register(w.pidfd, selectors.EVENT_READ, ("exit", w.rank))
        with self._lock:
            self.workers = {w.rank: w for w in workers}
            abandoned = self._cancelled
        if abandoned:  # abandoned (another thread) while they were being started
            self.abandon()

    def _start(self, timeout: float) -> list[Observation]:
        """Get the processes (waiting at most ``timeout``); every rank's end when the run was
        called off first."""
        assert self._starter is not None
        with self._lock:
            cancelled = self._cancelled
        if not cancelled:
            workers = self._starter.poll(min(timeout, _START_POLL))
            if workers is None:
                return []
            self._starter = None
            self._attach(workers)
            return []
        self._starter.cancel()
        self._starter = None
        self._exited.update(range(self._ranks))
        return [Exited(rank, code=-signal.SIGTERM, signal="SIGTERM") for rank in range(self._ranks)]

    def started(self) -> bool:
        return self._starter is None and bool(self.workers)

    # ---- what happened ------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[Observation]:
        if self._starter is not None:
            started = self._start(timeout)
            if self._starter is not None or not self.workers:
                return started
            timeout = 0.0
        if any(w.pidfd is None for w in self.workers.values()):
            timeout = min(timeout, 0.05)  # no pidfd: exits are found by polling
        out: list[Observation] = []
        ready = self.sel.select(timeout)
        # Exits first: a death must be known before a peer's knock-on report is read. Then what
        # the ranks wrote: what a rank wrote before an event (a session's reply) comes before it.
        for key, _ in sorted(ready, key=lambda kv: _ORDER.get(kv[0].data[0], 2)):
            kind, rank = key.data
            if kind == "wake":
                self._drain_wake()
            elif kind == "exit":
                self._on_exit(rank, out)
            elif (rank, kind) in self._fds:
                self._read(rank, kind, out)
        self._poll_exits(out)
        return out

    def settle(self, silent: Sequence[int]) -> list[Observation]:
        out: list[Observation] = []
        if self._starter is not None:
            return out
        for rank, kind in list(self._fds):
            self._drain(rank, kind, out)
        self._await_dying(silent)
        self._poll_exits(out)
        return out

    def _await_dying(self, silent: Sequence[int]) -> None:
        """Wait (briefly) for the exit status of workers whose event pipe closed without a report.

        A dying process closes its pipes (and its sockets, which is what its peers notice) before
        it becomes a zombie; tearing down a large address space can take that long. Its exit is
        certain, and needed to blame it rather than the peer that noticed."""
        for rank in silent:
            w = self.workers[rank]
            if rank in self._exited or (rank, "event") in self._fds:
                continue
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                if w.pidfd is not None:
                    if select.select([w.pidfd], [], [], max(0.0, deadline - time.monotonic()))[0]:
                        break
                elif w.ended():
                    break
                else:
                    time.sleep(0.005)

    def _poll_exits(self, out: list[Observation]) -> None:
        for rank, w in self.workers.items():
            if rank in self._exited:
                continue
            if w.ended():
                self._on_exit(rank, out)

    def _on_exit(self, rank: int, out: list[Observation]) -> None:
        if rank in self._exited:
            return
        self._exited.add(rank)
        w = self.workers[rank]
        if w.pidfd is not None:
            self.sel.unregister(w.pidfd)
        for kind in _STREAMS:
            self._drain(rank, kind, out)  # whatever it wrote before dying
        rc = w.reap()
        out.append(Exited(rank, code=rc, signal=signal_name(-rc) if rc < 0 else None, pid=w.pid, lost=w.proc.lost,
                          lost_kind=FailureKind.SERVER))

    # ---- reading pipes --------------------------------------------------------------------------
    def _read(self, rank: int, kind: str, out: list[Observation]) -> None:
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
                self._output(rank, kind, b"", out, final=True)
        elif kind == "event":
            for event, blob in self._decoders[rank].feed(data):
                # A result's tensors are in the worker's shared memory: opened now, while it waits
                # to be released, so they outlive it.
                table = event.pop("data", None)
                result = Received.adopt(blob, table) if blob is not None else None
                if result is not None and result.sender_gone:
                    continue  # it died before its result could be taken: its exit says how
                out.append(WorkerEvent(rank, event, result))
        else:
            self._output(rank, kind, data, out)

    def _drain(self, rank: int, kind: str, out: list[Observation]) -> None:
        while (rank, kind) in self._fds:
            if not select.select([self._fds[(rank, kind)]], [], [], 0)[0]:
                return
            self._read(rank, kind, out)

    def _output(self, rank: int, stream: str, data: bytes, out: list[Observation], final: bool = False) -> None:
        """Whole lines of output (a partial line waits for the rest, up to a chunk)."""
        buf = self._partial.pop((rank, stream), b"") + data
        if not final and b"\n" in buf and len(buf) < _CHUNK:
            cut = buf.rindex(b"\n") + 1
            buf, rest = buf[:cut], buf[cut:]
            if rest:
                self._partial[(rank, stream)] = rest
        elif not final and len(buf) < _CHUNK:
            self._partial[(rank, stream)] = buf
            return
        # One decoder per stream: a character split between two reads is decoded whole.
        decoder = self._text.setdefault((rank, stream), codecs.getincrementaldecoder("utf-8")(errors="replace"))
        text = decoder.decode(buf, final=final)
        if text:
            out.append(Output(rank, stream, text))

    def _close(self, rank: int, kind: str) -> None:
        """Close one pipe through its owner (Popen's file objects would close a reused fd later)."""
        fd = self._fds.pop((rank, kind))
        self.sel.unregister(fd)
        w = self.workers[rank]
        if kind == "event":
            os.close(fd)
        else:
            (w.stdout if kind == "stdout" else w.stderr).close()

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 64):
                pass
        except BlockingIOError:
            pass

    # ---- requests -------------------------------------------------------------------------------
    def wake(self) -> None:
        # From another thread (Run.stop): never into a closed pipe, whose number may be reused.
        with self._lock:
            if not self._closed:
                try:
                    os.write(self._wake_w, b"!")
                except OSError:
                    pass

    # Before the processes exist a request has nothing to reach: a stop is followed at once by an
    # interrupt (the supervisor gives no grace to ranks that never started), which calls the start off.
    def request_stop(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            if rank in self.workers:
                self.workers[rank].send_control(_STOP)

    def request_flush(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            if rank in self.workers:
                self.workers[rank].send_control(_FLUSH)

    def release(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            if rank in self.workers:
                self.workers[rank].send_control(_RELEASE)

    def send(self, ranks: Sequence[int], request: dict[str, Any], body: Optional[bytes] = None,
             give_up: Optional[Callable[[], bool]] = None) -> list[int]:
        frame = encode(dict(request, kind=Control.REQUEST), body)  # once, for every rank
        with self._lock:
            workers = dict(self.workers)
        return [r for r in ranks if r not in workers or not workers[r].send_control(frame, give_up)]

    def interrupt(self, ranks: Sequence[int]) -> None:
        self._signal(ranks, signal.SIGTERM)

    def kill(self, ranks: Sequence[int]) -> None:
        self._signal(ranks, signal.SIGKILL)

    def _signal(self, ranks: Sequence[int], signum: int) -> None:
        with self._lock:
            if self._starter is not None:
                self._cancelled = True
                return
        for rank in ranks:
            self.workers[rank].signal_group(signum)

    def request_stacks(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            if rank in self.workers:
                try:
                    os.kill(self.workers[rank].pid, STACK_SIGNAL)
                except ProcessLookupError:
                    pass

    def cpu_seconds(self, ranks: Sequence[int]) -> dict[int, Optional[float]]:
        out: dict[int, Optional[float]] = {}
        for rank in ranks:
            out[rank] = None
            if rank in self.workers and rank not in self._exited:  # not reaped yet: the pid is still its own
                out[rank] = _cpu_with_children(self.workers[rank].pid)
        return out

    def abandon(self) -> None:
        with self._lock:
            self._cancelled = True
            workers = list(self.workers.values())
        for w in workers:
            w.signal_group(signal.SIGKILL)

    def close(self) -> None:
        if self._starter is not None:
            self._starter.cancel()
            self._starter = None
        for rank, w in self.workers.items():
            if rank not in self._exited and w.returncode is None:  # only after a bug: never leave one
                w.signal_group(signal.SIGKILL)
                w.reap()
            w.close()
        for rank, kind in list(self._fds):
            self._close(rank, kind)
        self.sel.close()
        with self._lock:
            self._closed = True
            os.close(self._wake_r)
            os.close(self._wake_w)
