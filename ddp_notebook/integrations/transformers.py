"""Hugging Face ``Trainer`` under ddp_notebook.

A ``Trainer`` made inside a launched function trains on the run's ranks and shows its step, max
steps, epoch and logs (loss, learning rate, grad norm) in the panel with no change to the code::

    def train(ctx):
        trainer = Trainer(model=model, args=TrainingArguments(output_dir="out", use_cpu=True), train_dataset=data)
        trainer.train()
        return trainer.model.state_dict()

    state = ddp_notebook.launch(train, devices="cpu*2").wait()

Explicit use: ``Trainer(..., callbacks=[DDPNotebookCallback])``.
"""
from __future__ import annotations

from transformers import TrainerCallback

from ..worker.frameworks.transformers import progress_callback

__all__ = ["DDPNotebookCallback"]

DDPNotebookCallback = progress_callback(TrainerCallback)
# Named as here, so that the class reaches the workers by reference (pickled by name), not as a copy.
DDPNotebookCallback.__module__, DDPNotebookCallback.__qualname__ = __name__, "DDPNotebookCallback"
