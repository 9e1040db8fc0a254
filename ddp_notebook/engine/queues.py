"""The notebook's end of the call's queues: what the workers ``put`` (``core.queues``) goes into
the very queue the user made, in the order each rank put it.

Example::

    q = torch.multiprocessing.SimpleQueue()
    ddp_notebook.spawn(train, args=(q,), nprocs=2)   # train(rank, q) calls q.put(...)
    results = [q.get() for _ in range(2)]
"""
from __future__ import annotations

import threading
import warnings
from collections import deque
from typing import Any

from ..core.shared_load import Received

__all__ = ["QueueFeeder"]


class QueueFeeder:
    """Puts the items of one run's ranks into ``queues``, from a thread of its own: a queue's
    ``put`` can block (a ``SimpleQueue`` writes to a pipe that holds 64 kB until someone reads),
    and the thread that supervises the ranks must never wait for the user."""

    def __init__(self, queues: list[Any]) -> None:
        self.queues = queues
        self._pending: deque[tuple[Any, Any]] = deque()
        self._lock = threading.Lock()
        self._feeding = False

    def deliver(self, index: Any, received: Received) -> None:
        """The item a rank put in queue ``index`` of the call (its tensors mapped, not copied)."""
        if not (isinstance(index, int) and 0 <= index < len(self.queues)):
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
