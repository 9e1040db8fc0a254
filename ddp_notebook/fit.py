"""The built-in DDP fit, in the spirit of burn's ``Learner::fit``.

>>> import torch, ddp_notebook
>>> x = torch.randn(256, 4); y = x.sum(1, keepdim=True)
>>> result = ddp_notebook.fit(model=torch.nn.Linear(4, 1), train_data=(x, y), loss=torch.nn.MSELoss(),
...                           optimizer=lambda p: torch.optim.SGD(p, lr=0.1), epochs=3, batch_size=32,
...                           devices="cpu*2")
>>> result.history[-1]["train_loss"] < result.history[0]["train_loss"], result.ranks_in_sync
(True, True)
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional, Union

from .devices import Device, DeviceSpec
from .errors import DDPNotebookError, InvalidDevicesError, PreflightError, WorkerFailedError
from .launcher import first_unpicklable, launch_with, options_from, validate_for
from .run import Run
from .validation import Finding, ValidationReport

__all__ = ["fit", "FitResult", "FitConfigError"]


class FitConfigError(DDPNotebookError, ValueError):
    """An argument of ``fit`` is not usable (nothing was started)."""


@dataclass
class FitSpec:
    """What every worker needs to run the fit (sent to the workers)."""

    model: Any
    train_data: Any
    valid_data: Any
    loss: Callable
    optimizer: Any
    epochs: int
    batch_size: int
    valid_batch_size: int
    metrics: dict
    shuffle: bool
    drop_last: bool
    grad_accum: int
    early_stopping: Optional[int]
    monitor: str
    mode: str
    min_delta: float
    checkpoint: bool
    seed: int


@dataclass
class FitResult:
    """What ``fit`` gives back: the trained model (main worker's weights), the per-epoch
    history, whether every rank ended with identical weights, and the run itself."""

    model: Any
    history: list[dict]
    run: Run
    ranks_in_sync: bool
    stopped_early: bool = False
    resumed_from_epoch: Optional[int] = None

    @property
    def checkpoint_dir(self) -> str:
        return self.run.checkpoint_dir

    def __repr__(self) -> str:
        last = self.history[-1] if self.history else {}
        losses = ", ".join(f"{k}={v:.4g}" for k, v in last.items() if k.endswith("loss") and isinstance(v, float))
        return (f"FitResult(epochs={len(self.history)}, {losses}, ranks_in_sync={self.ranks_in_sync}, "
                f"stopped_early={self.stopped_early}, run={self.run.id!r})")


# ---- notebook side -------------------------------------------------------------------------

def _as_dataset(data: Any, name: str) -> Any:
    if data is None:
        return None
    if isinstance(data, (tuple, list)) and data and all(hasattr(t, "shape") for t in data):
        import torch
        from torch.utils.data import TensorDataset

        lengths = {len(t) for t in data}
        if len(lengths) != 1:
            raise FitConfigError(f"{name} is a tuple of tensors of different lengths {sorted(lengths)}; "
                                 "give (inputs, targets) with one row per sample.")
        return TensorDataset(*[t if isinstance(t, torch.Tensor) else torch.as_tensor(t) for t in data])
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return data
    raise FitConfigError(f"{name} must be a Dataset (with __len__ and __getitem__) or a tuple of tensors "
                         f"(inputs, targets), not {type(data).__name__}.")


def _check_args(epochs: int, batch_size: int, grad_accum: int, loss: Any, metrics: Any, early_stopping: Any,
                mode: str) -> None:
    for name, value in (("epochs", epochs), ("batch_size", batch_size), ("grad_accum", grad_accum)):
        if not isinstance(value, int) or value < 1:
            raise FitConfigError(f"{name} must be a whole number >= 1, not {value!r}.")
    if not callable(loss):
        raise FitConfigError(f"loss must be a function loss(prediction, target), such as torch.nn.MSELoss(); "
                             f"got {type(loss).__name__}.")
    if not isinstance(metrics, dict) or not all(callable(f) for f in metrics.values()):
        raise FitConfigError("metrics must be a dict of name -> function(prediction, target).")
    if early_stopping is not None and (not isinstance(early_stopping, int) or early_stopping < 1):
        raise FitConfigError(f"early_stopping is the patience in epochs (>= 1) or None, not {early_stopping!r}.")
    if mode not in ("min", "max"):
        raise FitConfigError(f"mode must be 'min' or 'max', not {mode!r}.")


def _build_model(model: Any) -> Any:
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


def _preflight(spec: FitSpec, device: Device, options: Any) -> None:
    """One forward/backward step on the main device before any DDP worker starts."""
    if device.kind != "cpu":
        # Never touch CUDA in the notebook process: run the step in a one-worker run.
        run = launch_with(_preflight_step, [device], (spec,), {}, options)
        try:
            run.wait()
        except WorkerFailedError as e:
            raise PreflightError(f"The single-device preflight step on {device} failed, so no DDP worker was "
                                 f"started: {e.failure.summary()}") from e
        return
    try:
        _preflight_step(None, spec)
    except FitConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - any bug in the user's model, loss or metrics
        raise PreflightError(f"The single-device preflight step on {device} failed, so no DDP worker was "
                             f"started: {type(e).__name__}: {e}") from e


def _preflight_step(ctx: Any, spec: FitSpec) -> None:
    import torch
    from torch.utils.data import DataLoader

    device = ctx.device if ctx is not None else torch.device("cpu")
    model = _build_model(copy.deepcopy(spec.model) if isinstance(spec.model, torch.nn.Module) else spec.model)
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


def _fit_result(value: dict, run: Run, model: Any) -> FitResult:
    import torch

    target = model if isinstance(model, torch.nn.Module) else model()
    target.load_state_dict(value["state_dict"])
    return FitResult(model=target, history=value["history"], run=run, ranks_in_sync=value["ranks_in_sync"],
                     stopped_early=value["stopped_early"], resumed_from_epoch=value["resumed_from_epoch"])


def fit(
    model: Any,
    train_data: Any,
    loss: Callable,
    optimizer: Any = None,
    *,
    epochs: int = 1,
    batch_size: int = 32,
    devices: Optional[DeviceSpec] = None,
    valid_data: Any = None,
    metrics: Optional[dict] = None,
    valid_batch_size: Optional[int] = None,
    shuffle: bool = True,
    drop_last: bool = False,
    grad_accum: int = 1,
    early_stopping: Optional[int] = None,
    monitor: Optional[str] = None,
    mode: str = "min",
    min_delta: float = 0.0,
    checkpoint: bool = True,
    preflight: bool = True,
    seed: int = 0,
    wait: bool = True,
    **launch_options: Any,
) -> Union[FitResult, Run]:
    """Train ``model`` with DistributedDataParallel on ``devices``; return the trained model.

    ``model`` is a ``torch.nn.Module`` (trained in place: the main worker's weights are loaded
    back into it) or a function returning one. ``train_data``/``valid_data`` are Datasets or
    ``(inputs, targets)`` tensors; each sample is ``(inputs..., target)``. ``optimizer`` is an
    optimizer class or ``lambda params: torch.optim.SGD(params, lr=0.1)`` (default Adam, lr 1e-3).
    ``batch_size`` is per worker (the global batch is ``batch_size * len(devices)``).

    Per epoch every rank trains on its shard; the main worker validates (``valid_loss`` and
    each of ``metrics``), checkpoints, and all ranks stop together on ``early_stopping``
    (patience in epochs, watching ``monitor`` — default ``valid_loss``, else ``train_loss``).
    Before anything starts: the device list and every rank's shard are validated, and (with
    ``preflight``) one forward/backward step runs on the main device so plain bugs surface at
    once with a normal traceback. ``wait=False`` returns the ``Run``; its ``wait()`` then
    returns the ``FitResult``. Other keyword arguments are ``launch`` options.
    """
    import torch

    metrics = dict(metrics or {})
    _check_args(epochs, batch_size, grad_accum, loss, metrics, early_stopping, mode)
    train = _as_dataset(train_data, "train_data")
    valid = _as_dataset(valid_data, "valid_data")
    if not isinstance(model, torch.nn.Module) and not callable(model):
        raise FitConfigError(f"model must be a torch.nn.Module or a function returning one, not {type(model).__name__}.")
    options = options_from("fit", launch_options)
    report = validate_for(devices, options, dataset_size=len(train), batch_size=batch_size, drop_last=drop_last)
    if valid is not None and len(valid) == 0:
        report = ValidationReport(report.spec, report.devices, report.backend, report.findings + (
            Finding("error", "empty_shard", "valid_data is empty: give at least one sample, or valid_data=None."),))
    if not report.ok:
        raise InvalidDevicesError(report)
    monitor = monitor or ("valid_loss" if valid is not None else "train_loss")
    allowed = {"train_loss"} | ({"valid_loss", *metrics} if valid is not None else set())
    if monitor not in allowed:
        raise FitConfigError(f"monitor {monitor!r} is not recorded; choose one of {', '.join(sorted(allowed))}.")
    spec = FitSpec(model=model, train_data=train, valid_data=valid, loss=loss, optimizer=optimizer, epochs=epochs,
                   batch_size=batch_size, valid_batch_size=valid_batch_size or batch_size, metrics=metrics,
                   shuffle=shuffle, drop_last=drop_last, grad_accum=grad_accum, early_stopping=early_stopping,
                   monitor=monitor, mode=mode, min_delta=min_delta, checkpoint=checkpoint, seed=seed)
    problem = first_unpicklable([(f"fit({name}=...)", getattr(spec, name)) for name in
                                 ("model", "train_data", "valid_data", "loss", "optimizer", "metrics")])
    if problem is not None:
        raise problem
    if preflight:
        _preflight(spec, report.devices[0], options)
    options = replace(options, postprocess=lambda value, run: _fit_result(value, run, model))
    run = launch_with(_fit_worker, list(report.devices), (spec,), {}, options, report=report)
    return run.wait() if wait else run


# ---- worker side ---------------------------------------------------------------------------

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


def _fit_worker(ctx: Any, spec: FitSpec) -> Optional[dict]:
    import torch
    import torch.distributed as dist

    torch.manual_seed(spec.seed)
    module = _build_model(spec.model).to(ctx.device)
    history: list[dict] = []
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
    best, patience_left, stopped_early = None, spec.early_stopping, False
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
        record: dict[str, Any] = {"epoch": epoch, "train_loss": float(totals[0] / max(totals[1], 1)),
                                  "seconds": time.perf_counter() - started}
        record["samples_per_s"] = float(totals[1]) / record["seconds"]
        if spec.valid_data is not None:
            box = [_evaluate(module, spec, ctx.device) if ctx.is_main else None]
            if ctx.world_size > 1:
                dist.broadcast_object_list(box, src=0)  # every rank needs it to stop together
            record.update(box[0])
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
            "ranks_in_sync": in_sync, "stopped_early": stopped_early, "resumed_from_epoch": start - 1 if state else None}

