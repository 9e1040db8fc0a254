"""The built-in fit's training loop: what every rank runs (``fit`` sends ``fit_worker``).

Per epoch every rank trains on its shard (``ctx.loader``), the cross-rank mean loss is
all-reduced, the main worker validates and checkpoints, and all ranks stop together on early
stopping. ``preflight_step`` is the one forward/backward step ``fit`` runs before any DDP worker.
"""
from __future__ import annotations

import contextlib
import copy
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import FitConfigError, NonFiniteLossError
from ..worker.channel import take_answers

__all__ = ["FitSpec", "fit_worker", "preflight_step", "build_model"]


@dataclass
class FitSpec:
    """What every worker needs to run the fit (sent to the workers)."""

    model: Any
    train_data: Any
    valid_data: Any
    loss: Callable[..., Any]
    optimizer: Any
    epochs: int
    batch_size: int
    valid_batch_size: int
    metrics: dict[str, Callable[..., Any]]
    shuffle: bool
    drop_last: bool
    grad_accum: int
    early_stopping: Optional[int]
    monitor: str
    mode: str
    min_delta: float
    checkpoint: bool
    seed: int
    keep_checkpoints: Optional[int] = 2  # the last ones kept (None: every one), and the best with valid_data


#: Seconds an epoch waits at most for the notebook's verdict on the one before (then it begins).
VERDICT_WAIT = 60.0


class _Verdicts:
    """The notebook's verdicts on the epochs of a judged fit (``verdict`` requests, sent once the
    trial took an epoch's value and did not prune): the next epoch begins once the last one was
    judged, or the run was stopped (pruned), so that a pruned fit records no epoch after the one
    it was pruned at (an epoch shorter than the verdict's way ended before the stop came)."""

    def __init__(self) -> None:
        self._last = -1  # the last epoch judged
        self._changed = threading.Condition()

    def told(self, frame: dict[str, Any]) -> None:
        with self._changed:
            self._last = max(self._last, int(frame.get("epoch", -1)))
            self._changed.notify_all()

    def wait(self, epoch: int, ctx: Any) -> None:
        ctx._send_held()  # the epoch's values, held by the throttle, go now
        deadline = time.monotonic() + VERDICT_WAIT
        with self._changed:
            # (a stop sets its own flag, not this condition: looked at every 10 ms)
            while self._last < epoch and not ctx.should_stop and time.monotonic() < deadline:
                self._changed.wait(0.01)


def build_model(model: Any) -> Any:
    import torch

    built = model if isinstance(model, torch.nn.Module) else model()
    if not isinstance(built, torch.nn.Module):
        raise FitConfigError(f"model must be a torch.nn.Module or a function returning one; "
                             f"it gave {type(built).__name__}.")
    return built


def _build_optimizer(optimizer: Any, params: Any) -> Any:
    import torch

    if optimizer is None:
        return torch.optim.Adam(params, lr=1e-3)
    return optimizer(params)  # an optimizer class or a factory: both take the parameters


def _split(batch: Any, device: Any) -> tuple[list, Any]:
    items = [t.to(device) if hasattr(t, "to") else t for t in (batch if isinstance(batch, (list, tuple)) else [batch])]
    if len(items) < 2:
        raise FitConfigError("each sample must be (inputs..., target): the data yields a single item per sample.")
    return items[:-1], items[-1]


def preflight_step(ctx: Any, spec: FitSpec) -> None:
    import torch
    from torch.utils.data import DataLoader

    device = ctx.device if ctx is not None else torch.device("cpu")
    model = build_model(copy.deepcopy(spec.model) if isinstance(spec.model, torch.nn.Module) else spec.model)
    model = model.to(device)
    _build_optimizer(spec.optimizer, model.parameters())
    xs, y = _split(next(iter(DataLoader(spec.train_data, batch_size=spec.batch_size))), device)
    out = model(*xs)
    value = spec.loss(out, y)
    if not math.isfinite(value.item()):
        raise NonFiniteLossError(f"the loss of the first batch is {value.item()}, before any step")
    value.backward()
    if spec.valid_data is not None:
        model.eval()
        with torch.no_grad():
            xs, y = _split(next(iter(DataLoader(spec.valid_data, batch_size=spec.valid_batch_size))), device)
            out = model(*xs)
            valid = float(spec.loss(out, y))
            if not math.isfinite(valid):
                raise NonFiniteLossError(f"the validation loss of the first batch is {valid}")
            for fn in spec.metrics.values():
                float(fn(out, y))


def _evaluate(model: Any, spec: FitSpec, device: Any) -> dict:
    import torch
    from torch.utils.data import DataLoader

    model.eval()
    sums = {"valid_loss": 0.0, **{k: 0.0 for k in spec.metrics}}
    n = 0
    with torch.no_grad():
        for batch in DataLoader(spec.valid_data, batch_size=spec.valid_batch_size):
            xs, y = _split(batch, device)
            out = model(*xs)
            b = len(y)
            sums["valid_loss"] += float(spec.loss(out, y)) * b
            for k, fn in spec.metrics.items():
                sums[k] += float(fn(out, y)) * b
            n += b
    model.train()
    return {k: v / n for k, v in sums.items()}


def _ranks_in_sync(module: Any, ctx: Any) -> bool:
    """True when every rank holds bit-identical parameters (DDP's promise, checked).

    The bits are compared, as integers: the same nan on every rank is in sync (a float
    comparison says nan != nan), and a max/min over floats is undefined for nan anyway."""
    if ctx.world_size == 1:
        return True
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1).double() for p in module.parameters()]).view(torch.int64)
    if ctx.backend != "nccl":
        flat = flat.cpu()
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def _check_finite(loss: float, ctx: Any, epoch: int, batch: int, n_batches: int) -> None:
    """Fail at the step the loss stops being a number: training on would only spread the nan
    to every rank's weights (one all-reduce later) and end in a "successful" fit of nans."""
    if not math.isfinite(loss):
        # Neither rank nor value in the text: the report names the worker, and ranks that diverge
        # at the same step (one to inf, one to nan) then read as one error of the run. Epochs are
        # said from 1, as the panel shows them (the history's numbers count from 0, as range does).
        raise NonFiniteLossError(f"the loss is nan or inf at step {ctx.step} (epoch {epoch + 1}, batch {batch} of "
                                 f"{n_batches})")


def _rng_states(ctx: Any) -> list[dict[str, Any]]:
    """Every rank's random state (torch, CUDA, Python, numpy), gathered for the checkpoint: dropout
    and augmentations of a resumed fit then draw what the uninterrupted one would have."""
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    mine = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state(ctx.device) if ctx.device.type == "cuda" else None}
    if ctx.world_size == 1:
        return [mine]
    states: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(states, mine)
    return states


def _restore_rng(states: Optional[list[dict[str, Any]]], ctx: Any) -> None:
    """This rank's random state from a checkpoint (rank 0's when the fit resumes on more ranks)."""
    if not states:
        return
    import random

    import numpy as np
    import torch

    mine = states[ctx.rank] if ctx.rank < len(states) else states[0]
    torch.set_rng_state(mine["torch"].cpu())
    random.setstate(mine["python"])
    np.random.set_state(mine["numpy"])
    if mine.get("cuda") is not None and ctx.device.type == "cuda":
        torch.cuda.set_rng_state(mine["cuda"].cpu(), ctx.device)


def _check_epoch(module: Any, record: dict[str, Any], epoch: int, step: int) -> None:
    """Before an epoch's checkpoint: weights that overflowed on a step whose loss was still finite,
    or a validation loss that is not a number, end the fit here (on every rank alike: the
    weights and the record are the same everywhere), and nothing of it is saved."""
    import torch

    if not all(bool(torch.isfinite(p).all()) for p in module.parameters()):
        raise NonFiniteLossError(f"the weights hold nan or inf after epoch {epoch + 1} (step {step}), though the loss "
                                 "was finite: the epoch's checkpoint is not saved")
    valid = record.get("valid_loss")
    if valid is not None and not math.isfinite(valid):
        raise NonFiniteLossError(f"the validation loss is nan or inf after epoch {epoch + 1}: look for nan or inf in "
                                 "valid_data")


@dataclass
class _EarlyStopping:
    """Where early stopping stands; saved in each checkpoint so a resumed fit stops where the
    original would have."""

    patience: Optional[int]
    sign: float
    min_delta: float
    best: Optional[float] = None
    patience_left: int = 0
    stopped: bool = False

    def update(self, value: float) -> bool:
        """Record an epoch's monitored value; True when the fit should stop now."""
        if self.patience is None:
            return False
        score = self.sign * value
        if self.best is None or score < self.best - self.min_delta:
            self.best, self.patience_left = score, self.patience
        else:
            self.patience_left -= 1
            self.stopped = self.patience_left <= 0
        return self.stopped

    def state(self, monitor: str) -> dict[str, Any]:
        return {"monitor": monitor, "sign": self.sign, "best": self.best, "patience_left": self.patience_left,
                "stopped": self.stopped}

    def restore(self, saved: Optional[dict[str, Any]], monitor: str) -> None:
        """Take up the saved state when it watched the same value the same way."""
        if saved and saved.get("monitor") == monitor and saved.get("sign") == self.sign:
            self.best, self.stopped = saved["best"], bool(saved["stopped"])
            left = int(saved["patience_left"])
            self.patience_left = min(left, self.patience) if self.patience is not None else left


def _is_best(history: list[dict[str, Any]], spec: FitSpec) -> bool:
    """Whether the last epoch of ``history`` is the best so far by ``spec.monitor`` (the
    validation loss by default): its checkpoint is kept beside the last ones. Only with
    validation data (a training loss says little of which weights are best); a resumed fit's
    history counts the epochs before it.

    >>> spec = FitSpec(None, None, "valid", None, None, 3, 1, 1, {}, True, False, 1, None, "valid_loss", "min", 0.0,
    ...                True, 0)
    >>> [_is_best([{"valid_loss": v} for v in [3.0, 1.0, 2.0][:n]], spec) for n in (1, 2, 3)]
    [True, True, False]
    """
    if spec.valid_data is None or not history or not isinstance(history[-1].get(spec.monitor), (int, float)):
        return False
    sign = 1.0 if spec.mode == "min" else -1.0
    earlier = [sign * r[spec.monitor] for r in history[:-1] if isinstance(r.get(spec.monitor), (int, float))]
    return not earlier or sign * history[-1][spec.monitor] < min(earlier)


def fit_worker(ctx: Any, spec: FitSpec) -> Optional[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(spec.seed)
    module = build_model(spec.model).to(ctx.device)
    history: list[dict[str, Any]] = []
    start = 0
    stopping = _EarlyStopping(spec.early_stopping, 1.0 if spec.mode == "min" else -1.0, spec.min_delta)
    state = ctx.load_checkpoint()
    if state is not None:
        module.load_state_dict(state["model"])
        history, start = list(state["history"]), state["epoch"] + 1
        stopping.restore(state.get("early_stopping"), spec.monitor)
        if stopping.stopped:  # the original fit had stopped early there: nothing is left to train
            start = max(start, spec.epochs)
    model = ctx.prepare(module)
    opt = _build_optimizer(spec.optimizer, model.parameters())
    if state is not None and state.get("optimizer") is not None:
        opt.load_state_dict(state["optimizer"])
    loader = ctx.loader(spec.train_data, batch_size=spec.batch_size, shuffle=spec.shuffle,
                        drop_last=spec.drop_last, seed=spec.seed)
    if state is not None:
        _restore_rng(state.get("rng"), ctx)
    verdicts = _Verdicts() if ctx._judged else None  # (a run with an Optuna trial)
    if verdicts is not None and not take_answers("verdict", verdicts.told):  # (an engine the notebook cannot reach)
        verdicts = None
    for epoch in ctx.epochs(spec.epochs, start=start):
        started = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64)
        n_batches, done = len(loader), 0
        for i, batch in enumerate(ctx.batches(loader)):
            xs, y = _split(batch, ctx.device)
            boundary = (i + 1) % spec.grad_accum == 0 or i + 1 == n_batches
            # Between accumulation boundaries, skip DDP's gradient all-reduce.
            sync = contextlib.nullcontext() if boundary or ctx.world_size == 1 else model.no_sync()
            with sync:
                value = spec.loss(model(*xs), y)
                loss = value.item()
                _check_finite(loss, ctx, epoch, i + 1, n_batches)
                (value / spec.grad_accum).backward()
            if boundary:
                opt.step()
                opt.zero_grad(set_to_none=True)
            totals += torch.tensor([loss * len(y), len(y)], dtype=torch.float64)
            ctx.log(loss=loss)
            done = i + 1
        if done < n_batches:  # a stop (the user's, a pruned trial's) cut the epoch short, on every rank at
            break  # once: no epoch of the record, no validation, no checkpoint (the last one is the last whole epoch)
        if ctx.world_size > 1:
            dist.all_reduce(totals)  # the cross-rank mean loss of the epoch
        record: dict[str, Any] = {"epoch": epoch, "train_loss": float(totals[0]) / max(float(totals[1]), 1.0),
                                  "seconds": time.perf_counter() - started}
        record["samples_per_s"] = float(totals[1]) / record["seconds"]
        if spec.valid_data is not None:
            box = [_evaluate(module, spec, ctx.device) if ctx.is_main else None]
            if ctx.world_size > 1:
                dist.broadcast_object_list(box, src=0)  # every rank needs it to stop together
            record.update(box[0] or {})
        _check_epoch(module, record, epoch, ctx.step)
        history.append(record)
        ctx.log(epoch=epoch, **{k: v for k, v in record.items() if k not in ("epoch", "seconds")})
        # The epoch's time as the panel, %ddp_status and Run.history show it (its validation
        # included); samples_per_s stays the training part's pace.
        shown = ctx.epoch_seconds(epoch)
        if shown is not None:
            record["seconds"] = shown
        stop = stopping.update(record[spec.monitor])  # every rank sees the same record: they stop together
        if spec.checkpoint:
            ctx.save_checkpoint({"model": module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                                 "history": history, "early_stopping": stopping.state(spec.monitor),
                                 "rng": _rng_states(ctx)}, epoch, keep=spec.keep_checkpoints,
                                best=_is_best(history, spec))
        if stop:
            break
        if verdicts is not None and epoch + 1 < spec.epochs:
            verdicts.wait(epoch, ctx)
    if verdicts is not None:
        take_answers("verdict", None)
    in_sync = _ranks_in_sync(module, ctx)
    if not ctx.is_main:
        return None
    return {"state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()}, "history": history,
            "ranks_in_sync": in_sync, "stopped_early": stopping.stopped,
            "resumed_from_epoch": state["epoch"] if state is not None else None}
