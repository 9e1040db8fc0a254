"""How a rank's events leave it (one ``Channel`` with two carriers), and how the notebook's
control frames reach it (``watch_lifeline`` on a worker process's control pipe,
``watch_requests`` on an engine, from a store the notebook hosts; both ``obey`` each frame).

``PipeChannel`` writes frames (``core.events``) to the pipe a worker process inherited;
``DataChannel`` publishes ipyparallel data messages from an engine, under increasing keys that
the notebook reads in order. Both stamp the rank and the time, and are safe to call from any
thread (progress may be logged from a DataLoader or a callback thread).
"""
from __future__ import annotations

import contextlib
import itertools
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any, Optional

from ..core.events import Control, EventKind, FrameDecoder, encode, read_frame, write_all
from .boot import EXIT_ORPHANED

__all__ = ["Channel", "PipeChannel", "DataChannel", "watch_lifeline", "watch_requests", "obey", "rank_channel",
           "take_requests", "take_answers", "request_key"]

_channels: weakref.WeakSet[Channel] = weakref.WeakSet()
_rank_channel: Optional[Channel] = None  # this worker's (one per worker process)
# Who serves the notebook's requests on this rank (a session's loop): called on the lifeline's
# thread with each request frame, its body under ``blob``.
_requests: Optional[Callable[[dict[str, Any]], None]] = None
# Who takes the notebook's frames of an ``op`` of their own, likewise: ``queue_answer``, its answers
# about the call's queues (``transfer.queues``); ``verdict``, a trial's on an epoch (``recipes.fit_loop``).
_takers: dict[str, Callable[[dict[str, Any]], None]] = {}


def rank_channel() -> Channel:
    """This worker's channel (a session's loop answers the notebook through it).

    Raises
    ------
    RuntimeError
        Outside a worker process.
    """
    if _rank_channel is None:
        raise RuntimeError("no rank's channel in this process: a session's loop runs only in a worker")
    return _rank_channel


def take_requests(handler: Optional[Callable[[dict[str, Any]], None]]) -> None:
    """Hand the notebook's requests (``Control.REQUEST`` frames) to ``handler`` from now on
    (None: they are dropped, as they are before anyone takes them).

    Raises
    ------
    RuntimeError
        No request can reach this rank (an engine that cannot reach the notebook's store): said
        with the address it tried.
    """
    global _requests
    if handler is not None and _rank_channel is not None and _rank_channel.unreachable:
        raise RuntimeError(_rank_channel.unreachable)
    _requests = handler


def take_answers(op: str, handler: Optional[Callable[[dict[str, Any]], None]]) -> bool:
    """Hand the notebook's ``op`` requests (``queue_answer``, ``verdict``) to ``handler`` from now
    on (None: they are dropped again); whether they can reach this rank (not from a notebook whose
    store an engine cannot reach)."""
    if handler is None:
        _takers.pop(op, None)
    else:
        _takers[op] = handler
    return _rank_channel is None or not _rank_channel.unreachable


def _after_fork_in_child() -> None:
    # Threads send too (the progress flusher, the pulse): a child forked while one of them held
    # the lock would find it locked forever.
    for channel in list(_channels):
        channel._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Channel:
    """``send(event, blob=None)``: fill in rank and time, then hand the event to the carrier."""

    #: Why no request of the notebook can reach this rank ('' when they can).
    unreachable = ""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self._lock = threading.Lock()  # one event at a time, whole, whichever thread sends it
        _channels.add(self)

    def send(self, event: dict[str, Any], blob: Optional[bytes] = None) -> None:
        event.setdefault("rank", self.rank)
        event.setdefault("time", time.time())
        with self._lock:
            self._carry(event, blob)

    def _carry(self, event: dict[str, Any], blob: Optional[bytes]) -> None:
        raise NotImplementedError


class PipeChannel(Channel):
    """Frames on an inherited pipe; a broken pipe means the notebook is gone: leave at once."""

    def __init__(self, fd: int, rank: int) -> None:
        global _rank_channel
        super().__init__(rank)
        self.fd = fd
        _rank_channel = self

    def _carry(self, event: dict[str, Any], blob: Optional[bytes]) -> None:
        frame = encode(event, blob)
        with _interrupts_after():
            try:
                write_all(self.fd, frame)
            except OSError:
                os._exit(EXIT_ORPHANED)


@contextlib.contextmanager
def _interrupts_after() -> Iterator[None]:
    """On the main thread, SIGINT and SIGTERM handled once the block is done, not inside it: an
    interrupt (a session's cell, a Stop) raised in the middle of a frame larger than the pipe
    holds would make the notebook read what follows as the frame's rest."""
    if threading.current_thread() is not threading.main_thread():
        yield  # (a signal's handler runs on the main thread only)
        return
    caught: list[int] = []
    held = {signum: handler for signum in (signal.SIGINT, signal.SIGTERM)
            if callable(handler := signal.getsignal(signum))}
    for signum in held:
        signal.signal(signum, lambda number, frame: caught.append(number))
    try:
        yield
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
        for number in caught:
            held[signal.Signals(number)](number, None)  # (KeyboardInterrupt, say, raised here)


class DataChannel(Channel):
    """ipyparallel data messages, keyed so the notebook reads them in order (an attachment
    travels under ``blob``, as bytes); this engine's rank channel until ``close()``."""

    def __init__(self, rank: int, publish: Optional[Callable[[dict[str, Any]], None]] = None) -> None:
        global _rank_channel
        super().__init__(rank)
        if publish is None:
            from ipyparallel.datapub import publish_data  # only on an engine

            publish = publish_data
        self._publish = publish
        self._seq = itertools.count()
        _rank_channel = self

    def _carry(self, event: dict[str, Any], blob: Optional[bytes]) -> None:
        self._publish({f"{next(self._seq):012d}": event if blob is None else dict(event, blob=blob)})

    def close(self) -> None:
        """The rank's call ends: the engine has no rank channel any more."""
        global _rank_channel
        if _rank_channel is self:
            _rank_channel = None


def obey(frame: dict[str, Any], stop: threading.Event, release: threading.Event,
         flush: Optional[Callable[[], None]] = None) -> bool:
    """Act on one control frame of the notebook (``core.events.Control``): stop asked; send
    held-back progress (the stall watchdog asks, so a hung rank's report names its true last
    step); every rank is done (True: stop reading); a session's request (to ``take_requests``'
    handler), a ``ping`` answered here."""
    kind = frame.get("kind")
    if kind == Control.STOP:
        stop.set()
    elif kind == Control.FLUSH and flush is not None:
        # Its own thread: this one must never wait on a lock the main thread may hold.
        threading.Thread(target=flush, name="ddp-flush", daemon=True).start()
    elif kind == Control.RELEASE:
        release.set()
        return True
    elif kind == Control.REQUEST and frame.get("op") == "ping":  # the supervisor settles a failure
        if _rank_channel is not None:
            _rank_channel.send({"kind": EventKind.PONG})  # from this thread: a dying rank cannot
    elif kind == Control.REQUEST and (taker := _takers.get(str(frame.get("op")))) is not None:
        taker(frame)
    elif kind == Control.REQUEST and _requests is not None:
        _requests(frame)
    return False


def watch_lifeline(fd: int, stop: threading.Event, release: threading.Event,
                   flush: Optional[Callable[[], None]] = None) -> None:
    """Read the control pipe of a worker process, one frame at a time, and ``obey`` each.
    EOF = the notebook is gone, so leave at once."""
    while True:
        frame = read_frame(fd)
        if frame is None:
            os._exit(EXIT_ORPHANED)
        if obey(frame, stop, release, flush):
            return


def request_key(rank: int, seq: int) -> str:
    """The store key of the notebook's ``seq``-th frame to ``rank``: its number of parts, each
    part under ``{key}/{i}`` (a store value holds at most 8 MiB)."""
    return f"req/{rank}/{seq}"


def watch_requests(store: Any, rank: int, stop: threading.Event) -> None:
    """An engine's rank: the notebook's control frames, read in order from the store it hosts
    (``request_key``), each obeyed, until a ``RELEASE`` frame (the run is over). The store gone
    (the notebook died) makes a session's rank leave, out of the cell it runs too, as a worker
    process's lifeline ends it: the engine is free again."""
    store.set_timeout(timedelta(days=7))  # a session may sit idle for days: each read waits
    release = threading.Event()
    for seq in itertools.count():
        key = request_key(rank, seq)
        try:
            parts = int(store.get(key))
            data = b"".join(store.get(f"{key}/{i}") for i in range(parts))
        except Exception:  # noqa: BLE001 - DistNetworkError: the notebook is gone
            if _requests is not None:
                _requests({"kind": Control.REQUEST, "op": "leave"})
            return
        for event, blob in FrameDecoder().feed(data):
            if obey(event if blob is None else dict(event, blob=blob), stop, release):
                return
