"""Multiprocessing queues in a call: a worker's end of the notebook's queue, both ways.

``torch.multiprocessing.spawn(fn, args=(q,))`` hands its children a queue they inherit; our
workers are not the notebook's children, so a queue cannot travel as itself. ``transfer.packing``
packs each ``multiprocessing`` queue of the call as a reference, and the worker gets a
``QueueEnd`` in its place, which works as the inherited queue would: ``put`` sends the item to
the notebook over the worker's event pipe (its tensors through shared memory, as a result comes
back), where the run's ``QueueFeeder`` puts it into the very queue the user made; ``get``,
``empty`` and ``qsize`` ask the notebook, whose feeder asks that queue and answers on the
worker's control pipe. Each rank's puts and questions are served in the order it made them.

Example (the worker's side; the notebook's ``q.get()`` then returns ``(0, 0.5)``)::

    def train(rank, q):
        q.put((rank, 0.5))
        if not q.empty():
            work = q.get()
"""
from __future__ import annotations

import functools
import itertools
import queue
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable
from typing import Any, Optional, Protocol

from ..core.errors import QueueUseError
from ..core.events import EventKind
from . import pickling

__all__ = ["QueueEnd", "QueueFeeder", "Asker", "is_queue", "send_items_with", "ask_with"]


class Loadable(Protocol):
    """What a rank sent, still to be loaded here (``loading.Received``)."""

    def load(self) -> Any: ...


_sender: Optional[Callable[[int, Any], None]] = None
_asker: Optional[Callable[[int, str, bool, Optional[float]], Any]] = None
Tell = Callable[[list[int], dict[str, Any], Optional[bytes]], Any]  # (ranks, request, its attachment): sends it
_LOOK = 0.1  # seconds between two looks at a queue a rank waits on (the run may end meanwhile)
_NOT_CONNECTED = ("this queue is the notebook's, reached from a ddp_notebook worker; it is not connected here (pass it "
                  "to a launch or spawn, and use it inside the function)")


@functools.lru_cache(maxsize=1)
def _queue_types() -> tuple[type, ...]:
    import multiprocessing.queues as mpq

    return (mpq.Queue, mpq.SimpleQueue)


def is_queue(obj: Any) -> bool:
    """A ``multiprocessing`` (or ``torch.multiprocessing``) queue: ``Queue``, ``JoinableQueue``,
    ``SimpleQueue``."""
    return isinstance(obj, _queue_types())


def send_items_with(sender: Optional[Callable[[int, Any], None]]) -> None:
    """How this worker sends ``(queue index, item)`` to the notebook (``worker.process`` sets it)."""
    global _sender
    _sender = sender


def ask_with(asker: Optional[Callable[[int, str, bool, Optional[float]], Any]]) -> None:
    """How this worker asks the notebook's queue ``(index, op, block, timeout)`` and gets its answer
    (``worker.process`` sets it: an ``Asker``'s ``ask``)."""
    global _asker
    _asker = asker


class Asker:
    """A worker's questions to the notebook's queues: ``ask`` sends one as an event and waits for
    the answer, which the worker's lifeline hands to ``answered``."""

    def __init__(self, send: Callable[[dict[str, Any]], None]) -> None:
        self._send = send
        self._ids = itertools.count()
        self._waiting: dict[int, list[Any]] = {}  # id -> [answered, answer]
        self._lock = threading.Lock()

    def ask(self, index: int, op: str, block: bool, timeout: Optional[float]) -> Any:
        """The item got (``op`` get), or whether the queue is empty, or its size.

        Raises
        ------
        queue.Empty
            A get found no item (at once, or within ``timeout``).
        QueueUseError
            The notebook's queue could not answer (its error, said).
        """
        with self._lock:
            n = next(self._ids)
            slot = self._waiting[n] = [threading.Event(), None]
        self._send({"kind": EventKind.QUEUE_ASK, "queue": index, "op": op, "id": n, "block": block,
                    "timeout": timeout})
        slot[0].wait()  # always answered: the notebook gone ends this process (its lifeline)
        with self._lock:
            answer: dict[str, Any] = self._waiting.pop(n)[1]
        if answer.get("error"):
            raise QueueUseError(f"the notebook's queue could not answer {op}(): {answer['error']}")
        if answer.get("empty"):
            raise queue.Empty
        return pickling.loads(answer["blob"]) if op == "get" else answer.get("value")

    def answered(self, frame: dict[str, Any]) -> None:
        """The notebook's answer (a ``queue_answer`` request, the item under ``blob``)."""
        with self._lock:
            slot = self._waiting.get(frame.get("id"))  # type: ignore[arg-type]
        if slot is not None:
            slot[1] = frame
            slot[0].set()


class QueueEnd:
    """A worker's end of a queue the notebook holds: ``put`` sends, in order, to that queue."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (QueueEnd, (self.index,))

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if _sender is None:
            raise QueueUseError(_NOT_CONNECTED)
        _sender(self.index, obj)

    def put_nowait(self, obj: Any) -> None:
        self.put(obj)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        return self._ask("get", bool(block), timeout)

    def get_nowait(self) -> Any:
        return self.get(False)

    def empty(self) -> bool:
        return bool(self._ask("empty"))

    def qsize(self) -> int:
        return int(self._ask("qsize"))

    def _ask(self, op: str, block: bool = False, timeout: Optional[float] = None) -> Any:
        if _asker is None:
            raise QueueUseError(_NOT_CONNECTED)
        return _asker(self.index, op, block, timeout)

    def full(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass

    def cancel_join_thread(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<QueueEnd {self.index}: the notebook's queue, reached from this worker>"


# ---- the notebook's end ---------------------------------------------------------------------
class QueueFeeder:
    """Serves the call's ``queues`` for one run's ranks: puts each item a rank put, and answers
    each question a rank asked (``tell([rank], answer, item)`` sends the answer), from a thread per
    rank, in the order the rank made them. A queue's ``put`` can block (a ``SimpleQueue`` writes to a
    pipe that holds 64 kB until someone reads), a ``get`` waits for an item, and the thread that
    supervises the ranks must never wait for the user. ``over()`` says when the run has ended (a
    get waiting for an item gives up then)."""

    def __init__(self, queues: list[Any], tell: Optional[Tell] = None,
                 over: Callable[[], bool] = lambda: False) -> None:
        self.queues = queues
        self.tell = tell
        self.over = over
        self._pending: dict[int, deque[tuple[Any, ...]]] = {}
        self._lock = threading.Lock()
        self._feeding: set[int] = set()
        self._taking = threading.Lock()

    def deliver(self, rank: int, event: dict[str, Any], received: Optional[Loadable]) -> None:
        """What a rank did with a queue of the call (``event``'s ``queue`` is its index): an item
        it put (its tensors mapped, not copied), or a question it asked."""
        index = event.get("queue")
        kind = event.get("kind")
        if not (isinstance(index, int) and 0 <= index < len(self.queues)):
            return  # not a queue of this call: nothing a worker of ours sends
        if kind == EventKind.QUEUE_ASK:
            self._add(rank, ("ask", self.queues[index], event))
            return
        if kind != EventKind.QUEUE_PUT or received is None:
            return
        try:
            item = received.load()
        except Exception as exc:  # noqa: BLE001 - the item is lost, and the user is told why
            warnings.warn(f"an item a worker put in a queue could not be loaded in the notebook, and was dropped: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)
            return
        self._add(rank, ("put", self.queues[index], item))

    def _add(self, rank: int, action: tuple[Any, ...]) -> None:
        with self._lock:
            self._pending.setdefault(rank, deque()).append(action)
            if rank in self._feeding:
                return
            self._feeding.add(rank)
        threading.Thread(target=self._feed, args=(rank,), name=f"ddp-queue-rank{rank}", daemon=True).start()

    def _feed(self, rank: int) -> None:
        while True:
            with self._lock:
                if not self._pending[rank]:
                    self._feeding.discard(rank)
                    return
                action = self._pending[rank].popleft()
            if action[0] == "put":
                try:
                    action[1].put(action[2])
                except Exception as exc:  # noqa: BLE001 - a closed queue: this item is lost, the next may not be
                    warnings.warn(f"an item a worker put in a queue was dropped: the notebook's queue refused it: "
                                  f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)
            else:
                self._answer(rank, action[1], action[2])

    def _answer(self, rank: int, q: Any, event: dict[str, Any]) -> None:
        op, block, timeout = event.get("op"), bool(event.get("block")), event.get("timeout")
        reply: dict[str, Any] = {"op": "queue_answer", "id": event.get("id")}
        body: Optional[bytes] = None
        try:
            if op == "get":
                item = _get(q, block, timeout if isinstance(timeout, (int, float)) else None, self.over, self._taking)
                if item is _NOTHING:
                    reply["empty"] = True
                else:
                    body = pickling.dumps(item)
            elif op == "empty":
                reply["value"] = bool(q.empty())
            elif op == "qsize":
                reply["value"] = int(q.qsize())
            else:
                reply["error"] = f"no such question: {op!r}"
        except Exception as exc:  # noqa: BLE001 - said to the rank, which raises it
            reply["error"] = f"{type(exc).__name__}: {exc}"
        if self.tell is not None:
            self.tell([rank], reply, body)


_NOTHING = object()


def _get(q: Any, block: bool, timeout: Optional[float], over: Callable[[], bool], taking: threading.Lock) -> Any:
    """An item of ``q`` as ``q.get(block, timeout)`` would give it, or ``_NOTHING``; a wait without
    end gives up when the run is ``over``."""
    import multiprocessing.queues as mpq

    if not isinstance(q, mpq.Queue):  # a SimpleQueue's get waits without end: look whether it holds one
        deadline = time.monotonic() + (max(0.0, float(timeout)) if block and timeout is not None else 0.0)
        while True:
            with taking:  # the ranks' threads look and take in turn (the notebook's own get could still race)
                if not q.empty():
                    return q.get()
            if (not block or timeout is not None) and time.monotonic() >= deadline or over():
                return _NOTHING
            time.sleep(0.01)
    if not block:
        try:
            return q.get(False)
        except queue.Empty:
            return _NOTHING
    until = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
    while not over():
        left = _LOOK if until is None else min(_LOOK, until - time.monotonic())
        if left <= 0:
            return _NOTHING
        try:
            return q.get(True, left)
        except queue.Empty:
            continue
    return _NOTHING
