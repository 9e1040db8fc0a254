"""Multiprocessing queues in a call: how a worker's ``q.put(x)`` reaches the notebook's queue.

``torch.multiprocessing.spawn(fn, args=(q,))`` hands its children a queue they inherit; our
workers are not the notebook's children, so a queue cannot travel as itself. ``transfer.packing``
packs each ``multiprocessing`` queue of the call as a reference, and the worker gets a
``QueueEnd`` in its place: ``put`` sends the item to the notebook over the worker's event pipe
(its tensors through shared memory, as a result comes back), where the run's ``QueueFeeder``
puts it into the very queue the user made. Items go one way, from the workers to the
notebook, which is how spawn's examples use a queue; ``get`` in a worker says so.

Example (the worker's side; the notebook's ``q.get()`` then returns ``(0, 0.5)``)::

    def train(rank, q):
        q.put((rank, 0.5))
"""
from __future__ import annotations

import functools
import threading
import warnings
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Optional

from ..core.errors import QueueUseError
from ..core.events import EventKind

if TYPE_CHECKING:
    from .loading import Received

__all__ = ["QueueEnd", "QueueFeeder", "is_queue", "send_items_with"]

_sender: Optional[Callable[[int, Any], None]] = None


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


class QueueEnd:
    """A worker's end of a queue the notebook holds: ``put`` sends, in order, to that queue."""

    def __init__(self, index: int) -> None:
        self.index = index

    def __reduce__(self) -> tuple[Any, ...]:
        return (QueueEnd, (self.index,))

    def put(self, obj: Any, block: bool = True, timeout: Optional[float] = None) -> None:
        if _sender is None:
            raise QueueUseError("this queue sends items from a ddp_notebook worker to the notebook; it is not "
                                "connected here (pass it to a launch or spawn, and put() inside the function)")
        _sender(self.index, obj)

    def put_nowait(self, obj: Any) -> None:
        self.put(obj)

    def get(self, block: bool = True, timeout: Optional[float] = None) -> Any:
        raise QueueUseError("a queue passed to the workers carries items from the workers to the notebook: "
                            "put() here, get() in the notebook. To give the workers data, pass it as an argument.")

    get_nowait = get

    def empty(self) -> bool:
        return True  # nothing is ever waiting at this end

    def full(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def join_thread(self) -> None:
        pass

    def cancel_join_thread(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<QueueEnd {self.index}: put() sends to the notebook's queue>"


# ---- the notebook's end ---------------------------------------------------------------------
class QueueFeeder:
    """Puts the items of one run's ranks into ``queues``, from a thread of its own: a queue's
    ``put`` can block (a ``SimpleQueue`` writes to a pipe that holds 64 kB until someone reads),
    and the thread that supervises the ranks must never wait for the user."""

    def __init__(self, queues: list[Any]) -> None:
        self.queues = queues
        self._pending: deque[tuple[Any, Any]] = deque()
        self._lock = threading.Lock()
        self._feeding = False

    def deliver(self, rank: int, event: dict[str, Any], received: Optional[Received]) -> None:
        """The item a rank put in a queue of the call (``event``'s ``queue`` is its index; its
        tensors mapped, not copied)."""
        index = event.get("queue")
        if event.get("kind") != EventKind.QUEUE_PUT or received is None or \
                not (isinstance(index, int) and 0 <= index < len(self.queues)):
            return  # not a queue of this call: nothing a worker of ours sends
        try:
            item = received.load()
        except Exception as exc:  # noqa: BLE001 - the item is lost, and the user is told why
            warnings.warn(f"an item a worker put in a queue could not be loaded in the notebook, and was dropped: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)
            return
        with self._lock:
            self._pending.append((self.queues[index], item))
            if self._feeding:
                return
            self._feeding = True
        threading.Thread(target=self._feed, name="ddp-queue-feeder", daemon=True).start()

    def _feed(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    self._feeding = False
                    return
                queue, item = self._pending.popleft()
            try:
                queue.put(item)
            except Exception as exc:  # noqa: BLE001 - a closed queue: this item is lost, the next may not be
                warnings.warn(f"an item a worker put in a queue was dropped: the notebook's queue refused it: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=1)
