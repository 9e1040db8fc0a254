"""Multiprocessing queues in a call: how a worker's ``q.put(x)`` reaches the notebook's queue.

``torch.multiprocessing.spawn(fn, args=(q,))`` hands its children a queue they inherit; our
workers are not the notebook's children, so a queue cannot travel as itself. ``core.shared_data``
packs each ``multiprocessing`` queue of the call as a reference, and the worker gets a
``QueueEnd`` in its place: ``put`` sends the item to the notebook over the worker's event pipe
(its tensors through shared memory, as a result comes back), where the run puts it into the
very queue the user made (``engine.queues``). Items go one way, from the workers to the
notebook, which is how spawn's examples use a queue; ``get`` in a worker says so.

Example (the worker's side; the notebook's ``q.get()`` then returns ``(0, 0.5)``)::

    def train(rank, q):
        q.put((rank, 0.5))
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Optional

from .errors import QueueUseError

__all__ = ["QueueEnd", "is_queue", "send_items_with"]

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
