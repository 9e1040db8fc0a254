"""PyTorch Lightning's ``Trainer``: a ``Callback`` that reports its progress to the rank's context.

Example (explicit; a worker adds it to every Trainer by itself)::

    from ddp_notebook.integrations.lightning import DDPNotebookCallback
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", callbacks=[DDPNotebookCallback()])
"""
from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any, Optional

from ..context import current_context
from .reporting import PROGRESS_MARK, epoch_of, finite_int, guarded, patch_init, scalars, stop_agreed

__all__ = ["progress_callback", "patch_trainer", "follow_the_run"]


@functools.cache
def progress_callback(base: type) -> type:
    """The reporting callback for the ``Callback`` class ``base`` (``lightning.pytorch`` and the
    older ``pytorch_lightning`` each check for their own)."""

    class DDPNotebookCallback(base):
        """Reports the Trainer's step (optimizer steps), total, epoch, loss and the metrics the
        module logs with ``self.log`` to ddp_notebook's panel, from every rank; ends the training
        at the same step on every rank after the run's Stop."""

        def __init__(self) -> None:
            super().__init__()
            self._loss: Any = None  # the last batch's loss (a tensor: read only when reported)

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self._report(trainer, force=True)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            loss = outputs.get("loss") if isinstance(outputs, Mapping) else outputs
            if loss is not None:
                self._loss = loss
            self._report(trainer)
            if stop_agreed():
                trainer.should_stop = True

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self._report(trainer, force=True)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            self._report(trainer, force=True)

        def on_train_end(self, trainer: Any, pl_module: Any) -> None:
            self._report(trainer, force=True)

        def _report(self, trainer: Any, force: bool = False) -> None:
            guarded(self._send, trainer, force)  # a report of ours never breaks the training

        def _send(self, trainer: Any, force: bool) -> None:
            ctx = current_context()
            if ctx is None:
                return
            try:
                total: Optional[int] = finite_int(trainer.estimated_stepping_batches)
            except Exception:  # noqa: BLE001 - some set-ups cannot tell before the loop runs
                total = None
            metrics: dict[str, Any] = {}
            if force or ctx.due():  # reading the metrics may wait for a GPU: only for a report that is sent
                metrics = scalars(trainer.callback_metrics)
                if "loss" not in metrics and self._loss is not None:
                    metrics.update(scalars({"loss": self._loss}))
            elif self._loss is not None and ctx.device.type == "cpu":  # every step's loss for the plot: free on a CPU
                metrics = scalars({"loss": self._loss})
            epochs = finite_int(trainer.max_epochs) or None
            ctx.log(step=trainer.global_step, total=total, epoch=epoch_of(trainer.current_epoch, epochs),
                    epochs=epochs, **metrics)

    setattr(DDPNotebookCallback, PROGRESS_MARK, True)
    return DDPNotebookCallback


def follow_the_run(kwargs: dict[str, Any]) -> dict[str, Any]:
    """A ``Trainer`` or ``Fabric`` made for another number of devices than the run has (a retry
    on one device of code written for ``devices=2``; ``devices="auto"`` on CPUs) runs on the
    run's: Lightning would refuse a world size that differs from ``devices * num_nodes``."""
    ctx = current_context()
    if ctx is None:
        return kwargs
    kwargs = _without_own_processes(kwargs)
    nodes = max(ctx.world_size // max(ctx.local_world_size, 1), 1)
    devices = kwargs.get("devices", "auto")
    count = len(devices) if isinstance(devices, (list, tuple)) else finite_int(devices)
    # Per host, as Lightning counts: devices=1, num_nodes=2 on one host would put two ranks on node 0.
    if count == ctx.local_world_size and finite_int(kwargs.get("num_nodes", 1) or 1) == nodes:
        return kwargs
    # One CUDA rank on cuda:3 must stay there: Lightning takes devices=1 as cuda:0.
    wanted: Any = ([ctx.device.index] if ctx.device.type == "cuda" and ctx.local_world_size == 1
                   else ctx.local_world_size)
    if devices != "auto" or "num_nodes" in kwargs:
        print(f"ddp_notebook: devices={devices!r}, num_nodes={kwargs.get('num_nodes', 1)!r} runs on this run's "
              f"{ctx.world_size} device(s) (devices={wanted!r}, num_nodes={nodes})", file=sys.stderr)
    return dict(kwargs, devices=wanted, num_nodes=nodes)


# Lightning's strategies that start processes of their own (by fork or spawn), whatever the
# environment says: in a worker they would fork it. Their "ddp" twin joins the run's group.
_OWN_PROCESSES = ("ddp_notebook", "ddp_fork", "ddp_spawn")


def _without_own_processes(kwargs: dict[str, Any]) -> dict[str, Any]:
    strategy = kwargs.get("strategy")
    if isinstance(strategy, str) and strategy.startswith(_OWN_PROCESSES):
        plain = "ddp" + strategy[len(next(p for p in _OWN_PROCESSES if strategy.startswith(p))):]  # (its suffix kept)
        print(f"ddp_notebook: strategy={strategy!r} runs as {plain!r} here: this run's workers are the processes "
              "(nothing is forked)", file=sys.stderr)
        return dict(kwargs, strategy=plain)
    if getattr(strategy, "_start_method", None) in ("fork", "spawn", "forkserver"):
        strategy._start_method = "popen"  # type: ignore[union-attr]  # (a DDPStrategy made with one)
    return kwargs


def patch_trainer(module: ModuleType) -> None:
    """Every ``Trainer`` of ``module`` (``lightning.pytorch.trainer.trainer`` or the older
    package's) runs on the run's devices and gets the reporting callback, unless it has one."""
    package = module.__name__.rsplit(".trainer.trainer", 1)[0]
    callback = progress_callback(importlib.import_module(f"{package}.callbacks").Callback)

    def add(trainer: Any) -> None:
        if not any(getattr(c, PROGRESS_MARK, False) for c in trainer.callbacks):
            trainer.callbacks.append(callback())

    patch_init(module.Trainer, add, before=follow_the_run)
