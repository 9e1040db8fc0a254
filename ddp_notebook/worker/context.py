"""What the training function receives as its first argument, inside a worker process: the
``WorkerContext``. Who the rank is, where it computes, how it reports, and the helpers of a DDP
training loop (model, data, epochs, checkpoints).

Example::

    def train(ctx, dataset, epochs):
        model = ctx.prepare(torch.nn.Linear(16, 1))          # on ctx.device, wrapped in DDP
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = ctx.loader(dataset, batch_size=64)          # this rank's shard, 64 a batch
        for epoch in ctx.epochs(epochs):                     # stops on every rank together
            for x, y in ctx.batches(loader):                 # reports step/total/epoch/samples_per_s
                x, y = x.to(ctx.device), y.to(ctx.device)
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                ctx.log(loss=loss.item())
            ctx.save_checkpoint({"model": ctx.unwrap(model).state_dict()}, epoch)  # main only
        return ctx.unwrap(model).state_dict() if ctx.is_main else None
"""
from __future__ import annotations

import io
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Optional

from ..core.bounds import bound_metrics
from ..core.events import EventKind, to_json_value
from ..core.rundir import RunDir, latest_checkpoint
from .loss_history import LossHistory

__all__ = ["WorkerContext", "ShardedLoader", "current_context", "set_current", "peak_memory"]

_current: Optional[WorkerContext] = None
# A report held back by the throttle goes out at the end of its interval from one thread per context
# (``WorkerContext._flush_when_due``), which leaves once nothing was held for this long and is
# started again by the next held report: a rank between runs (an engine) keeps no thread.
FLUSHER_IDLE = 1.0
# The flusher looks at most this often, whatever ``progress_interval`` is: a thread woken every
# millisecond would take the GIL from a fast loop (a thread started per held report cost about 8%
# of one's throughput: benchmarks/overhead_bench.py).
FLUSHER_TICK = 0.05
_contexts: weakref.WeakSet[WorkerContext] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A child forked while the flusher held the lock (a DataLoader worker, a user's fork) would
    # find it locked forever, and has no flusher: give it a fresh lock; its next held report
    # starts a flusher of its own.
    for ctx in list(_contexts):
        ctx._lock = threading.Lock()
        ctx._flusher = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def current_context() -> Optional[WorkerContext]:
    """The context of the worker this code runs in (None outside a worker).

    Code started with ``ddp_notebook.spawn`` gets no context argument; it can still report
    progress: ``ddp_notebook.current_context().log(step=i, total=n, loss=...)``.

    Returns
    -------
    WorkerContext or None
        This rank's context, or None in the notebook (or on an engine between runs).
    """
    return _current


def set_current(ctx: Optional[WorkerContext]) -> None:
    """Make ``ctx`` the context of this process (None when the rank is over, on an engine)."""
    global _current
    _current = ctx


class ShardedLoader:
    """A ``DataLoader`` over one rank's shard of a dataset (``ctx.loader`` makes it).

    Its ``DistributedSampler`` splits the dataset into ``world_size`` interleaved shards of equal
    length (padded by repeating samples unless ``drop_last``). Each pass sets the sampler's epoch
    (the context's current epoch inside ``ctx.epochs``, else the number of passes so far), so the
    shuffle differs from epoch to epoch and is the same on every rank for a given epoch and seed.
    ``len()`` is the number of batches of this rank's shard.
    """

    def __init__(self, ctx: WorkerContext, dataset: Any, batch_size: int, shuffle: bool, drop_last: bool,
                 seed: int, **loader_kwargs: Any) -> None:
        from torch.utils.data import DataLoader, DistributedSampler

        self._ctx = ctx
        self.sampler: DistributedSampler[Any] = DistributedSampler(
            dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self.sampler, drop_last=drop_last,
                                 **loader_kwargs)
        self.batch_size = batch_size
        self._passes = 0

    def __iter__(self) -> Iterator[Any]:
        epoch = self._ctx.epoch if self._ctx.epoch is not None else self._passes
        self.sampler.set_epoch(epoch)
        self._passes += 1
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)


class WorkerContext:
    """A worker's view of the run: who it is, where it computes, how it reports, and the helpers
    of a DDP training loop. The training function gets it as its first argument
    (``def train(ctx, ...)``); ``current_context()`` returns it anywhere in the worker. The
    worker makes it; user code never does.

    Examples
    --------
    ::

        def train(ctx, dataset, epochs):
            model = ctx.prepare(MyNet())                  # on ctx.device, wrapped in DDP
            opt = torch.optim.Adam(model.parameters())
            loader = ctx.loader(dataset, batch_size=64)   # this rank's shard, 64 a batch on each rank
            for epoch in ctx.epochs(epochs):              # leaves on every rank together after Stop
                for x, y in ctx.batches(loader):          # on ctx.device; step, total, samples/s reported
                    loss = F.cross_entropy(model(x), y)
                    opt.zero_grad(); loss.backward(); opt.step()
                    ctx.log(loss=loss.item())
                ctx.save_checkpoint({"model": ctx.unwrap(model).state_dict()}, epoch)
            return ctx.unwrap(model).state_dict() if ctx.is_main else None
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
        #: The position of the worker's device in the device list; rank 0 is the main worker,
        #: whose return value ``Run.wait()`` gives back.
        self.rank = rank
        #: How many ranks the run has.
        self.world_size = world_size
        #: The rank's index among the ranks on its host (on one machine: ``rank``).
        self.local_rank = rank if local_rank is None else local_rank
        #: How many ranks run on this rank's host (on one machine: ``world_size``).
        self.local_world_size = world_size if local_world_size is None else local_world_size
        #: Where this rank computes, a ``torch.device``: ``cuda:N`` for a GPU rank, else ``cpu``.
        self.device = device
        #: The device as the device list names it (``"cpu:1"``, ``"cuda:0"``).
        self.device_name = device_name
        #: The process group's backend, ``"gloo"`` or ``"nccl"`` (set up before the function is called).
        self.backend = backend
        #: The run's id (``20261129-174217-5266c4``).
        self.run_id = run_id
        #: The run's directory (in the notebook's runs folder).
        self.run_dir = run_dir
        # Every step's loss and each epoch's numbers (and on rank 0 every value logged), carried by
        # the reports that are sent, with the rank's peak memory.
        self._loss_history = LossHistory(record_points=rank == 0)
        self._send = self._reporting(send)
        self._stop_event = stop_event
        self._interval = progress_interval
        self._last_sent = 0.0
        self._pending: Optional[dict] = None
        # Held while a report is decided on and sent: the flusher's report never overtakes a later one.
        self._lock = threading.Lock()
        self._flusher: Optional[threading.Thread] = None
        _contexts.add(self)
        #: The checkpoint file this run resumes from (None: it starts afresh); ``load_checkpoint`` reads it.
        self.resume_from = resume_from
        # Ranks on engines (maybe on other hosts, with no shared file system): the checkpoint to
        # resume from arrives as bytes, and a saved one travels to the notebook as an event.
        # The runner's, not the user's (set by the engine's runner):
        self._resume_data: Optional[bytes] = None  # on an engine: the checkpoint to resume from, as bytes
        self._checkpoints_to_notebook = False  # on an engine: checkpoints go to the notebook, which writes them
        self._judged = False  # each epoch's value is judged in the notebook: fit's epochs wait for the verdicts
        #: The steps ``batches`` has counted (what ``log`` reports when not given a step).
        self.step = 0
        #: The current epoch of ``epochs`` (None outside it).
        self.epoch: Optional[int] = None
        #: The steps of the run in all, as ``batches`` counts them (None before the first ``batches``).
        self.total: Optional[int] = None
        self._epochs: Optional[int] = None
        self._first_epoch = 0

    def _reporting(self, send: Callable[[dict], None]) -> Callable[[dict], None]:
        """``send``, with what waits (``LossHistory``) and the rank's peak memory attached to each
        progress report it sends."""
        def send_report(event: dict[str, Any]) -> None:
            if event.get("kind") == EventKind.PROGRESS:
                event = dict(self._loss_history.attach(event), memory=peak_memory())
            send(event)
        return send_report

    @property
    def should_stop(self) -> bool:
        """True once the run was asked to stop (``Run.stop()``, the panel's Stop button).

        The flag reaches every rank within milliseconds but not at the same step; a loop
        that checks it should agree across ranks (for instance with an all_reduce of the
        flag) before leaving, or peers will wait in their next collective until forced."""
        return self._stop_event.is_set()

    def due(self) -> bool:
        """Whether a report now would be sent at once (not held back by ``progress_interval``).

        Returns
        -------
        bool
            True when ``log`` would send now: a loop can skip reading its metrics (a GPU sync)
            when it would not.
        """
        return time.monotonic() - self._last_sent >= self._interval

    def log(self, /, step: Optional[int] = None, total: Optional[int] = None, epoch: Optional[int] = None,
            epochs: Optional[int] = None, **metrics: Any) -> None:
        """Report progress: ``ctx.log(step=5, total=100, epoch=0, loss=0.31)``.

        Metric values may be numbers, strings or one-element tensors. Reports are sent at
        most every ``progress_interval`` seconds (the latest one wins, with the metrics of those
        it replaced); one held back goes out at the end of its interval even when no other report
        follows, and the last step of a run (``step == total``) is sent at once. ``epoch`` counts
        from 0; with ``epochs`` (how many) the panel shows "epoch 1/3". Inside ``ctx.epochs()`` /
        ``ctx.batches()`` the step, total and epochs are filled in: ``ctx.log(loss=...)`` is enough,
        and the epoch is always ``ctx.epochs``' own (one logged as ``epoch + 1`` is not taken).

        On rank 0 every number logged is kept, whatever the throttle: it makes the run's record
        (``Run.metrics``, ``Run.history``, the curves of :func:`ddp_notebook.compare`), and its
        trackers (``report_to``) and Optuna trial get each value at its step.

        Every metric shows on the rank's row of the panel and the text view (its latest value),
        and in ``run.workers[rank].metrics``; inside ``ctx.epochs()`` the epoch table holds the
        last value of each metric logged in each epoch (log ``valid_loss=...`` once an epoch, after
        validating, and it shows there beside the train loss). ``loss`` is also plotted: every
        step's value reaches the plot (binned on the rank), not only the reports sent.

        Parameters
        ----------
        step, total : int, optional
            The step reached and how many there are (``ctx.batches`` fills them in).
        epoch, epochs : int, optional
            The epoch (from 0) and how many (``ctx.epochs`` fills them in).
        **metrics : number, str or one-element tensor
            Named values: ``loss=0.31, acc=0.9``.
        """
        step = self.step if step is None and self.step else step
        total = self.total if total is None else total
        # Inside ctx.epochs the epoch is its own: "epoch + 1" logged by the loop would show N+1 of N.
        epoch = self.epoch if epoch is None or (self._epochs is not None and self.epoch is not None) else epoch
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
        self._loss_history.add(event.get("step"), event.get("epoch"), event["metrics"])  # throttled or not
        now = time.monotonic()
        with self._lock:
            if self._pending is not None:
                # keep metrics a throttled report would otherwise lose
                merged = bound_metrics(dict(self._pending["metrics"], **event["metrics"]))
                event = dict(self._pending, **event)
                event["metrics"] = merged
            final = step is not None and total is not None and step >= total
            if final or now - self._last_sent >= self._interval or self._loss_history.full:
                self._pending = None
                self._last_sent = now
                self._send(dict(event, time=time.time()))
                return
            # Held back: the flusher sends it when its interval ends, unless a report sent before
            # then carries it (merged above).
            self._pending = dict(event, time=time.time())  # when it happened, if sent later
            if self._flusher is None:
                self._flusher = threading.Thread(target=self._flush_when_due, name="ddp-progress", daemon=True)
                self._flusher.start()

    def _flush_when_due(self) -> None:
        """The flusher thread: send the held report once its interval has ended (stamped with when
        it was logged; it is progress made then), and leave after ``FLUSHER_IDLE`` s with none."""
        me = threading.current_thread()
        idle_since = time.monotonic()
        while True:
            with self._lock:
                if self._flusher is not me:  # replaced (a fork) or no longer wanted
                    return
                now = time.monotonic()
                if self._pending is None:
                    if now - idle_since >= FLUSHER_IDLE:
                        self._flusher = None
                        return
                    wait = max(self._interval, FLUSHER_TICK)
                else:
                    idle_since = now
                    due = self._last_sent + self._interval
                    if now >= due:
                        self._send_pending()
                        wait = max(self._interval, FLUSHER_TICK)
                    else:
                        wait = max(due - now, FLUSHER_TICK)
            time.sleep(min(wait, FLUSHER_IDLE))

    def _send_held(self) -> None:
        """Send now the report throttling holds back (a fit judged each epoch: the epoch's values
        go before the next epoch waits for their verdict), stamped with when it was logged."""
        with self._lock:
            self._send_pending()

    def _send_pending(self) -> None:
        """The held report sent (``_lock`` held), stamped with when it was logged: progress made then."""
        event, self._pending = self._pending, None
        if event is not None:
            self._last_sent = time.monotonic()
            self._send(event)

    def flush(self, held: bool = False) -> None:
        """Send a report held back by throttling (done when the function returns or fails).

        Parameters
        ----------
        held : bool, default False
            Sent on the supervisor's request: stamped with when it was logged and marked so,
            which is no sign of progress now.
        """
        with self._lock:
            event, self._pending = self._pending, None
            if not held:  # the function ended: its last loss bin and epoch go now, in a report of their own if need be
                self._loss_history.close()
                if event is None and self._loss_history.unsent:
                    event = {"kind": EventKind.PROGRESS, "rank": self.rank, "metrics": {}}
            if event is not None:
                self._last_sent = time.monotonic()
                self._send(dict(event, held=True) if held else dict(event, time=time.time()))

    # ---- model and data ----------------------------------------------------------------
    def prepare(self, model: Any, **ddp_kwargs: Any) -> Any:
        """Move ``model`` to this rank's device and wrap it in ``DistributedDataParallel``.

        Parameters
        ----------
        model : torch.nn.Module
            The model, built the same way on every rank (DDP broadcasts rank 0's weights).
        **ddp_kwargs
            Passed to ``DistributedDataParallel`` (``find_unused_parameters=True``, ...).

        Returns
        -------
        torch.nn.Module
            The wrapped model; the model itself, on its device, when the run has one rank.
            ``ctx.unwrap(model)`` gives the module back (for ``state_dict``).
        """
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **ddp_kwargs)

    @staticmethod
    def unwrap(model: Any) -> Any:
        """The module inside a ``DistributedDataParallel`` wrapper, or ``model`` itself.

        Parameters
        ----------
        model : torch.nn.Module
            What ``prepare`` returned.

        Returns
        -------
        torch.nn.Module
            The module to save or return (its ``state_dict`` keys have no ``module.`` prefix).
        """
        return getattr(model, "module", model)

    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, drop_last: bool = False, seed: int = 0,
               **loader_kwargs: Any) -> ShardedLoader:
        """A ``DataLoader`` over this rank's shard of ``dataset`` (a ``ShardedLoader``).

        Parameters
        ----------
        dataset : torch.utils.data.Dataset
            The whole dataset (every rank passes the same one; each reads its own shard).
        batch_size : int
            Samples per batch *on each rank*: a step of the run trains on ``batch_size *
            world_size`` samples in all.
        shuffle : bool, default True
            Shuffle within the shards, differently each epoch: the sampler's epoch is set on each
            pass (the current epoch inside ``ctx.epochs``), the same on every rank.
        drop_last : bool, default False
            Drop the samples that do not fill the last batch, and the tail that would make the
            shards unequal (else the shards are padded with repeated samples).
        seed : int, default 0
            The shuffle's seed (the same on every rank, or the shards would overlap).
        **loader_kwargs
            Passed to ``DataLoader`` (``num_workers``, ``pin_memory``, ``collate_fn``...).

        Returns
        -------
        ShardedLoader
            Iterate it for batches (on the CPU, as the dataset gives them), or pass it to
            ``ctx.batches``.
        """
        return ShardedLoader(self, dataset, batch_size, shuffle, drop_last, seed, **loader_kwargs)

    # ---- progress ----------------------------------------------------------------------
    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """The epoch numbers ``start .. n-1``, leaving early on every rank at once after a Stop.

        Parameters
        ----------
        n : int
            The number of epochs in all (the panel shows "epoch 3/n").
        start : int, default 0
            The first epoch (an epoch after a resumed checkpoint's).

        Yields
        ------
        int
            The epoch, counted from 0; ``ctx.epoch`` holds it, and ``log`` and ``batches`` report it.
        """
        self._epochs, self._first_epoch = n, start
        for epoch in range(start, n):
            if self.stop_agreed():
                return
            self.epoch = epoch
            yield epoch

    def epoch_seconds(self, epoch: int) -> Optional[float]:
        """How long ``epoch`` took as the panel, ``%ddp_status`` and ``Run.history`` show it:
        from the previous epoch's last report to its own last (``log`` after its validation
        included).

        Parameters
        ----------
        epoch : int
            The epoch (from 0), while it is the one this rank reports (before the next begins).

        Returns
        -------
        float or None
            Its seconds; None for an epoch this rank reported nothing in, or one already past.
        """
        return self._loss_history.seconds_of(epoch)

    def batches(self, loader: Any, to_device: bool = True) -> Iterator[Any]:
        """The batches of ``loader`` on this rank's device, counted and reported, leaving early on
        every rank at once after a Stop.

        Each batch counts one step (``ctx.step``, and the total of the run: batches per epoch
        times the epochs of ``ctx.epochs``); twice a second, and at the last step, a progress
        report with ``samples_per_s`` (samples of this rank) is sent.

        Parameters
        ----------
        loader : iterable with a length
            A ``ShardedLoader`` (``ctx.loader``) or any ``DataLoader``.
        to_device : bool, default True
            Move the tensors of each batch (alone, or in tuples, lists and dicts) to ``ctx.device``
            (a no-op on a CPU rank); False yields the batches as the loader gives them.

        Yields
        ------
        object
            Each batch of ``loader``, its tensors on ``ctx.device``.
        """
        per_epoch = len(loader)
        if self._epochs is not None:
            self.total = (self._epochs - self._first_epoch) * per_epoch
        else:
            self.total = self.step + per_epoch
        window_start, window_samples = time.perf_counter(), 0
        for batch in loader:
            if self.stop_agreed():
                self._loss_history.cut(self.epoch)  # an epoch cut short by a stop: no epoch of the record
                return
            self.step += 1
            yield _to_device(batch, self.device) if to_device and self.device.type != "cpu" else batch
            window_samples += _batch_len(batch)
            now = time.perf_counter()
            if now - window_start >= 0.5 or self.step == self.total:
                self.log(samples_per_s=window_samples / max(now - window_start, 1e-9))
                window_start, window_samples = now, 0

    def stop_agreed(self) -> bool:
        """Whether any rank saw the Stop request, agreed on by every rank (one small all_reduce:
        call it on every rank at the same point of the loop).

        Returns
        -------
        bool
            The same answer on every rank, so they all leave the loop at the same step.
        """
        flag = self.should_stop
        if self.world_size == 1:
            return flag
        import torch
        import torch.distributed as dist

        t = torch.tensor([1.0 if flag else 0.0], device=self.device if self.backend == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return bool(t.item())

    # ---- checkpoints -------------------------------------------------------------------
    @property
    def is_main(self) -> bool:
        """True on rank 0, the main worker (whose return value ``Run.wait()`` gives back)."""
        return self.rank == 0

    @property
    def checkpoint_dir(self) -> str:
        """The folder this run's checkpoints are saved in (in the run's directory)."""
        return RunDir(self.run_dir).checkpoint_dir

    def save_checkpoint(self, state: Any, epoch: int, keep: Optional[int] = 2, best: bool = False) -> Optional[str]:
        """Save ``state`` (with ``torch.save``) as the checkpoint of ``epoch``, on the main worker.

        The run keeps its last ``keep`` checkpoints (and the best); ``run.retry(resume=True)`` and
        ``fit(resume_from=run)`` give the latest one to ``load_checkpoint``.

        Parameters
        ----------
        state : object
            What to save: ``{"model": ctx.unwrap(model).state_dict(), "epoch": epoch, ...}``.
        epoch : int
            The epoch it was taken at (the file's name says it).
        keep : int or None, optional
            How many checkpoints the run keeps, those of the highest epochs (default 2); the
            latest and the one saved as the best are always kept. None keeps every one.
        best : bool, optional
            This one is the best so far (by your measure): kept until a better one is saved,
            however many come after it.

        Returns
        -------
        str or None
            The checkpoint's path on rank 0; None on the other ranks, which save nothing.

        Raises
        ------
        ValueError
            ``keep`` is not a whole number >= 1 or None.
        """
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(f"keep must be a whole number >= 1 (the checkpoints kept) or None (every one), "
                             f"not {keep!r}")
        if not self.is_main:
            return None
        import torch

        directory = RunDir(self.run_dir)
        event = {"kind": EventKind.CHECKPOINT, "rank": self.rank, "epoch": epoch,
                 "path": directory.checkpoint_path(epoch), "time": time.time(), "keep": keep, "best": bool(best)}
        if self._checkpoints_to_notebook:  # the notebook writes it where a local run would have
            buffer = io.BytesIO()
            torch.save(state, buffer)
            self._send(dict(event, data=buffer.getvalue()))
            return str(event["path"])
        path = directory.save_checkpoint(epoch, lambda f: torch.save(state, f), keep=keep, best=bool(best))
        self._send(event)
        return path

    def load_checkpoint(self) -> Any:
        """The checkpoint this run resumes from, loaded on this rank's device.

        Returns
        -------
        object or None
            What ``save_checkpoint`` saved in the run resumed from (``run.retry(resume=True)``,
            ``fit(resume_from=...)``), or None for a run that resumes nothing.
        """
        if not self.resume_from:
            return None
        import torch

        if self._resume_data is not None:
            return torch.load(io.BytesIO(self._resume_data), map_location=self.device, weights_only=False)
        path = self.resume_from if os.path.isfile(self.resume_from) else latest_checkpoint(self.resume_from)
        if path is None:
            return None
        return torch.load(path, map_location=self.device, weights_only=False)

    def __repr__(self) -> str:
        return (f"WorkerContext(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device_name!r}, backend={self.backend!r})")


def peak_memory() -> dict[str, int]:
    """This process's peak resident memory (``rss``) and, once it used a GPU, torch's peak
    allocation on its current device (``cuda``), in bytes: what is known of them."""
    out: dict[str, int] = {}
    try:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["rss"] = int(peak) * (1 if sys.platform == "darwin" else 1024)  # bytes on macOS, KiB on Linux
    except (ImportError, OSError):  # no getrusage (Windows)
        pass
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        out["cuda"] = int(torch.cuda.max_memory_allocated())
    return out


def _to_device(batch: Any, device: Any) -> Any:
    """``batch`` with its tensors (alone, or in tuples, lists and dicts) moved to ``device``."""
    if hasattr(batch, "to") and hasattr(batch, "device"):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [_to_device(b, device) for b in batch]
        return type(batch)(*moved) if hasattr(batch, "_fields") else type(batch)(moved)  # namedtuples too
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    return batch


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape else 1
