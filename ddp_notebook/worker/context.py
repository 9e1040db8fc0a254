"""What the training function receives as its first argument, inside a worker process.

Example::

    def train(ctx, steps):
        model = torch.nn.Linear(4, 1).to(ctx.device)
        for step in range(1, steps + 1):
            if ctx.should_stop:
                break
            ...
            ctx.log(step=step, total=steps, loss=loss.item())
        return model.state_dict() if ctx.is_main else None
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from ..core.bounds import bound_metrics
from ..core.events import EventKind, to_json_value
from .training import TrainingHelpers

__all__ = ["WorkerContext", "current_context", "set_current"]

_current: Optional[WorkerContext] = None


def current_context() -> Optional[WorkerContext]:
    """The context of the worker this code runs in (None outside a worker).

    Code started with ``ddp_notebook.spawn`` gets no context argument; it can still report
    progress: ``ddp_notebook.current_context().log(step=i, total=n, loss=...)``."""
    return _current


def set_current(ctx: Optional[WorkerContext]) -> None:
    """Make ``ctx`` the context of this process (None when the rank is over, on an engine)."""
    global _current
    _current = ctx


class WorkerContext(TrainingHelpers):
    """A worker's view of the run: who it is, where it computes, how it reports.

    ``rank`` is the position of the worker's device in the device list; rank 0 is the main
    worker. ``local_rank`` is the rank's index among the ranks on its host and
    ``local_world_size`` their number (on one machine: ``rank`` and ``world_size``; on engines
    spread over hosts, counted per host). ``device`` is the ``torch.device`` to compute on. The training helpers
    (``prepare``, ``loader``, ``epochs``, ``batches``, checkpoints) are described in
    :mod:`ddp_notebook.training`.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: Any,
        device_name: str,
        backend: str,
        run_id: str,
        run_dir: str,
        send: Callable[[dict], None],
        stop_event: threading.Event,
        progress_interval: float = 0.1,
        resume_from: Optional[str] = None,
        local_rank: Optional[int] = None,
        local_world_size: Optional[int] = None,
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.local_rank = rank if local_rank is None else local_rank
        self.local_world_size = world_size if local_world_size is None else local_world_size
        self.device = device
        self.device_name = device_name
        self.backend = backend
        self.run_id = run_id
        self.run_dir = run_dir
        self._send = send
        self._stop_event = stop_event
        self._interval = progress_interval
        self._last_sent = 0.0
        self._pending: Optional[dict] = None
        self._lock = threading.Lock()
        self.resume_from = resume_from

    @property
    def should_stop(self) -> bool:
        """True once the run was asked to stop (``Run.stop()``, the panel's Stop button).

        The flag reaches every rank within milliseconds but not at the same step; a loop
        that checks it should agree across ranks (for instance with an all_reduce of the
        flag) before leaving, or peers will wait in their next collective until forced."""
        return self._stop_event.is_set()

    def due(self) -> bool:
        """Whether a report now would be sent at once (not held back by ``progress_interval``):
        a loop can skip reading its metrics (a GPU sync) when it would not."""
        return time.monotonic() - self._last_sent >= self._interval

    def log(self, /, step: Optional[int] = None, total: Optional[int] = None, epoch: Optional[int] = None,
            epochs: Optional[int] = None, **metrics: Any) -> None:
        """Report progress: ``ctx.log(step=5, total=100, epoch=0, loss=0.31)``.

        Metric values may be numbers, strings or one-element tensors. Reports are sent at
        most every ``progress_interval`` seconds (the latest one wins); the last step of a run
        (``step == total``) is always sent. ``epoch`` counts from 0; with ``epochs`` (how many)
        the panel shows "epoch 1/3". Inside ``ctx.epochs()`` / ``ctx.batches()`` the step,
        total and epochs are filled in: ``ctx.log(loss=...)`` is enough.
        """
        step = self.step if step is None and self.step else step
        total = self.total if total is None else total
        epoch = self.epoch if epoch is None else epoch
        epochs = self._epochs if epochs is None else epochs
        event: dict[str, Any] = {"kind": EventKind.PROGRESS, "rank": self.rank}
        if step is not None:
            event["step"] = int(step)
        if total is not None:
            event["total"] = int(total)
        if epoch is not None:
            event["epoch"] = int(epoch)
            if epochs is not None:  # the panel shows "epoch k/n"
                event["epochs"] = int(epochs)
        event["metrics"] = bound_metrics({k: to_json_value(v, k) for k, v in metrics.items()})
        now = time.monotonic()
        with self._lock:
            if self._pending is not None:
                # keep metrics a throttled report would otherwise lose
                merged = bound_metrics(dict(self._pending["metrics"], **event["metrics"]))
                event = dict(self._pending, **event)
                event["metrics"] = merged
            final = step is not None and total is not None and step >= total
            if final or now - self._last_sent >= self._interval:
                self._pending = None
                self._last_sent = now
            else:
                # Held back; the next report after the interval, the end of the function or a
                # failure sends it. (A flush timer thread cost about 8% of a fast DDP loop's
                # throughput here: benchmarks/overhead_bench.py.)
                self._pending = dict(event, time=time.time())  # when it happened, if flushed later
                return
        self._send(dict(event, time=time.time()))

    def flush(self, held: bool = False) -> None:
        """Send a report held back by throttling (when the function returns or fails). ``held``:
        sent on the supervisor's request, stamped with when it was logged and marked so, which
        is no sign of progress now."""
        with self._lock:
            event, self._pending = self._pending, None
            if event is not None:
                self._last_sent = time.monotonic()
        if event is not None:
            self._send(dict(event, held=True) if held else dict(event, time=time.time()))

    def __repr__(self) -> str:
        return (f"WorkerContext(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device_name!r}, backend={self.backend!r})")
