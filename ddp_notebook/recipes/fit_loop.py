"""The built-in fit's training loop: what every rank runs (``fit`` sends ``fit_worker``).

Per epoch every rank trains on its shard (``ctx.loader``), the cross-rank mean loss is
all-reduced, the main worker validates and checkpoints, and all ranks stop together on early
stopping. ``preflight_step`` is the one forward/backward step ``fit`` runs before any DDP worker.
"""
from __future__ import annotations

import contextlib
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import FitConfigError

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
    spec.loss(out, y).backward()
    if spec.valid_data is not None:
        model.eval()
        with torch.no_grad():
            xs, y = _split(next(iter(DataLoader(spec.valid_data, batch_size=spec.valid_batch_size))), device)
            out = model(*xs)
            float(spec.loss(out, y))
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
    """True when every rank holds bit-identical parameters (DDP's promise, checked)."""
    if ctx.world_size == 1:
        return True
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1).float() for p in module.parameters()])
    if ctx.backend != "nccl":
        flat = flat.cpu()
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return bool(torch.equal(hi, lo))


def fit_worker(ctx: Any, spec: FitSpec) -> Optional[dict[str, Any]]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(spec.seed)
    module = build_model(spec.model).to(ctx.device)
    history: list[dict[str, Any]] = []
    start = 0
    state = ctx.load_checkpoint()
    if state is not None:
        module.load_state_dict(state["model"])
        history, start = list(state["history"]), state["epoch"] + 1
    model = ctx.prepare(module)
    opt = _build_optimizer(spec.optimizer, model.parameters())
    if state is not None and state.get("optimizer") is not None:
        opt.load_state_dict(state["optimizer"])
    loader = ctx.loader(spec.train_data, batch_size=spec.batch_size, shuffle=spec.shuffle,
                        drop_last=spec.drop_last, seed=spec.seed)
    best: Optional[float] = None
    patience_left, stopped_early = spec.early_stopping or 0, False
    sign = 1.0 if spec.mode == "min" else -1.0
    for epoch in ctx.epochs(spec.epochs, start=start):
        started = time.perf_counter()
        totals = torch.zeros(2, dtype=torch.float64)
        n_batches = len(loader)
        for i, batch in enumerate(ctx.batches(loader)):
            xs, y = _split(batch, ctx.device)
            boundary = (i + 1) % spec.grad_accum == 0 or i + 1 == n_batches
            # Between accumulation boundaries, skip DDP's gradient all-reduce.
            sync = contextlib.nullcontext() if boundary or ctx.world_size == 1 else model.no_sync()
            with sync:
                value = spec.loss(model(*xs), y)
                (value / spec.grad_accum).backward()
            if boundary:
                opt.step()
                opt.zero_grad(set_to_none=True)
            totals += torch.tensor([value.item() * len(y), len(y)], dtype=torch.float64)
            ctx.log(loss=value.item())
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
        history.append(record)
        ctx.log(epoch=epoch, **{k: v for k, v in record.items() if k not in ("epoch", "seconds")})
        if spec.checkpoint:
            ctx.save_checkpoint({"model": module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                                 "history": history}, epoch)
        if spec.early_stopping is not None:
            score = sign * record[spec.monitor]
            if best is None or score < best - spec.min_delta:
                best, patience_left = score, spec.early_stopping
            else:
                patience_left -= 1
                if patience_left <= 0:
                    stopped_early = True
                    break
    in_sync = _ranks_in_sync(module, ctx)
    if not ctx.is_main:
        return None
    return {"state_dict": {k: v.detach().cpu() for k, v in module.state_dict().items()}, "history": history,
            "ranks_in_sync": in_sync, "stopped_early": stopped_early,
            "resumed_from_epoch": start - 1 if state else None}

