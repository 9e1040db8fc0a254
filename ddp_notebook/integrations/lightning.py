"""PyTorch Lightning under ddp_notebook.

A ``Trainer`` made inside a launched function joins the run's process group and shows its step,
loss and logged metrics in the panel with no change to the code (``DDPNotebookCallback`` is added
to it). Code written for Lightning's own notebook strategy runs as it is, in a function::

    def train(ctx):
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", max_epochs=3)
        trainer.fit(model, loader)
        return model.state_dict()

    state = ddp_notebook.launch(train, devices="cpu*2").wait()
    model.load_state_dict(state)

Explicit use: ``L.Trainer(..., callbacks=[DDPNotebookCallback()])``.
"""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from ..worker.frameworks.lightning import progress_callback

__all__ = ["DDPNotebookCallback"]

DDPNotebookCallback = progress_callback(Callback)
# Named as here, so that the class reaches the workers by reference (pickled by name), not as a copy.
DDPNotebookCallback.__module__, DDPNotebookCallback.__qualname__ = __name__, "DDPNotebookCallback"
