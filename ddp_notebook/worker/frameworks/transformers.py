"""Hugging Face's ``Trainer``: a ``TrainerCallback`` that reports its progress to the rank's context.

Example (explicit; a worker adds it to every Trainer by itself)::

    from ddp_notebook.integrations.transformers import DDPNotebookCallback
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[DDPNotebookCallback])
"""
from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any, Optional

from ..context import current_context
from .reporting import PROGRESS_MARK, epoch_of, finite_int, guarded, patch_init, scalars, stop_agreed

__all__ = ["progress_callback", "patch_trainer"]


@functools.cache
def progress_callback(base: type) -> type:
    """The reporting callback for ``transformers.TrainerCallback`` (``base``)."""

    class DDPNotebookCallback(base):
        """Reports the Trainer's global step, max steps, epoch and what it logs (loss, learning
        rate, grad norm, eval loss...) to ddp_notebook's panel, from every rank; ends the
        training at the same step on every rank after the run's Stop."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _report(state, None)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            _report(state, None)
            if stop_agreed():
                control.should_training_stop = True

        def on_log(self, args: Any, state: Any, control: Any, logs: Optional[dict[str, Any]] = None,
                   **kwargs: Any) -> None:
            _report(state, logs)

    setattr(DDPNotebookCallback, PROGRESS_MARK, True)
    return DDPNotebookCallback


def _report(state: Any, logs: Optional[dict[str, Any]]) -> None:
    guarded(_send, state, logs)  # a report of ours never breaks the training


def _send(state: Any, logs: Optional[dict[str, Any]]) -> None:
    ctx = current_context()
    if ctx is not None:
        epochs = finite_int(getattr(state, "num_train_epochs", None)) or None
        ctx.log(step=state.global_step, total=finite_int(state.max_steps) or None,
                epoch=epoch_of(state.epoch or 0, epochs), epochs=epochs, **scalars(logs))


def patch_trainer(module: ModuleType) -> None:
    """Every ``transformers.Trainer`` gets the reporting callback, unless it has one."""
    callback = progress_callback(importlib.import_module("transformers.trainer_callback").TrainerCallback)

    def add(trainer: Any) -> None:
        if not any(getattr(c, PROGRESS_MARK, False) for c in trainer.callback_handler.callbacks):
            trainer.add_callback(callback)

    patch_init(module.Trainer, add)
