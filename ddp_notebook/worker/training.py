"""Worker-side helpers for a DDP training loop, available on the context as methods.

Example::

    def train(ctx, dataset, epochs):
        model = ctx.prepare(torch.nn.Linear(16, 1))          # on ctx.device, wrapped in DDP
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        loader = ctx.loader(dataset, batch_size=64)          # this rank's shard
        for epoch in ctx.epochs(epochs):                     # stops on every rank together
            for x, y in ctx.batches(loader):                 # reports step/total/epoch/samples_per_s
                loss = torch.nn.functional.mse_loss(model(x), y)
                opt.zero_grad(); loss.backward(); opt.step()
                ctx.log(loss=loss.item())
            ctx.save_checkpoint({"model": ctx.unwrap(model).state_dict()}, epoch)  # main only
        return ctx.unwrap(model).state_dict() if ctx.is_main else None
"""
from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from ..core.events import EventKind
from ..core.rundir import RunDir, latest_checkpoint

__all__ = ["TrainingHelpers", "ShardedLoader"]


class ShardedLoader:
    """A DataLoader over one rank's shard (``DistributedSampler``); the sampler's epoch is set
    on each pass, from the context's current epoch, so shuffling differs between epochs."""

    def __init__(self, ctx: TrainingHelpers, dataset: Any, batch_size: int, shuffle: bool, drop_last: bool,
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


class TrainingHelpers:
    """Mixed into ``WorkerContext``, which provides what is declared here without a body."""

    rank: int
    world_size: int
    device: Any
    backend: str
    run_dir: str
    _send: Callable[[dict[str, Any]], None]
    step: int = 0
    epoch: Optional[int] = None
    total: Optional[int] = None
    resume_from: Optional[str] = None
    # Ranks on engines (maybe on other hosts, with no shared file system): the checkpoint to resume
    # from arrives as bytes, and a saved one travels to the notebook as an event.
    resume_data: Optional[bytes] = None
    checkpoints_to_notebook: bool = False
    _epochs: Optional[int] = None
    _first_epoch: int = 0

    # ---- model and data ----------------------------------------------------------------
    def prepare(self, model: Any, **ddp_kwargs: Any) -> Any:
        """Move ``model`` to this worker's device and wrap it in DistributedDataParallel
        (not wrapped when the run has a single worker)."""
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids, **ddp_kwargs)

    @staticmethod
    def unwrap(model: Any) -> Any:
        """The module inside a DistributedDataParallel wrapper (or the model itself)."""
        return getattr(model, "module", model)

    def loader(self, dataset: Any, batch_size: int, shuffle: bool = True, drop_last: bool = False, seed: int = 0,
               **loader_kwargs: Any) -> ShardedLoader:
        """A DataLoader over this rank's shard of ``dataset``."""
        return ShardedLoader(self, dataset, batch_size, shuffle, drop_last, seed, **loader_kwargs)

    # ---- progress ----------------------------------------------------------------------
    def epochs(self, n: int, start: int = 0) -> Iterator[int]:
        """Yield epoch numbers ``start .. n-1``; leaves early, on every rank at once, after Stop."""
        self._epochs, self._first_epoch = n, start
        for epoch in range(start, n):
            if self.stop_agreed():
                return
            self.epoch = epoch
            yield epoch

    def batches(self, loader: Any) -> Iterator[Any]:
        """Yield the batches of ``loader``, counting steps and reporting step/total/epoch and
        samples/s; leaves early, on every rank at once, after Stop."""
        per_epoch = len(loader)
        if self._epochs is not None:
            self.total = (self._epochs - self._first_epoch) * per_epoch
        else:
            self.total = self.step + per_epoch
        window_start, window_samples = time.perf_counter(), 0
        for batch in loader:
            if self.stop_agreed():
                return
            self.step += 1
            yield batch
            window_samples += _batch_len(batch)
            now = time.perf_counter()
            if now - window_start >= 0.5 or self.step == self.total:
                self.log(samples_per_s=window_samples / max(now - window_start, 1e-9))
                window_start, window_samples = now, 0

    def stop_agreed(self) -> bool:
        """True on every rank once any rank saw the Stop request (one tiny all_reduce)."""
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
    def should_stop(self) -> bool:  # WorkerContext's
        raise NotImplementedError

    def log(self, step: Optional[int] = None, total: Optional[int] = None, epoch: Optional[int] = None,
            **metrics: Any) -> None:  # WorkerContext's
        raise NotImplementedError

    @property
    def checkpoint_dir(self) -> str:
        return RunDir(self.run_dir).checkpoint_dir

    def save_checkpoint(self, state: Any, epoch: int) -> Optional[str]:
        """Save ``state`` for ``epoch`` (main worker only; other ranks return None)."""
        if not self.is_main:
            return None
        import torch

        directory = RunDir(self.run_dir)
        event = {"kind": EventKind.CHECKPOINT, "rank": self.rank, "epoch": epoch,
                 "path": directory.checkpoint_path(epoch), "time": time.time()}
        if self.checkpoints_to_notebook:  # the notebook writes it where a local run would have
            buffer = io.BytesIO()
            torch.save(state, buffer)
            self._send(dict(event, data=buffer.getvalue()))
            return str(event["path"])
        path = directory.save_checkpoint(epoch, lambda f: torch.save(state, f))
        self._send(event)
        return path

    def load_checkpoint(self) -> Any:
        """The checkpoint this run resumes from (``run.retry(resume=True)``, ``fit(resume_from=...)``),
        or None."""
        if not self.resume_from:
            return None
        import torch

        if self.resume_data is not None:
            return torch.load(io.BytesIO(self.resume_data), map_location=self.device, weights_only=False)
        path = self.resume_from if os.path.isfile(self.resume_from) else latest_checkpoint(self.resume_from)
        if path is None:
            return None
        return torch.load(path, map_location=self.device, weights_only=False)


def _batch_len(batch: Any) -> int:
    first = batch[0] if isinstance(batch, (list, tuple)) and batch else batch
    shape = getattr(first, "shape", None)
    return int(shape[0]) if shape else 1
