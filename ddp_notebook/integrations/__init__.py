"""Training frameworks under ddp_notebook, for explicit use (a worker already does the same by
itself: see ``ddp_notebook.worker.frameworks``).

Owns: the public names of each framework's callback or tracker, and the drop-ins for the
frameworks' own notebook launchers.

- ``ddp_notebook.integrations.lightning``: ``DDPNotebookCallback`` for a Lightning ``Trainer``;
- ``ddp_notebook.integrations.transformers``: ``DDPNotebookCallback`` for a Hugging Face ``Trainer``;
- ``ddp_notebook.integrations.accelerate``: ``DDPNotebookTracker`` for an ``Accelerator``, and
  ``notebook_launcher``, a drop-in for accelerate's.

Each module imports its framework (``pip install ddp-notebook[lightning]`` or ``[hf]``); this
package imports none.

May import: ``ddp_notebook.recipes``, ``ddp_notebook.lifecycle``, ``ddp_notebook.worker`` and
``ddp_notebook.core``. Never a front end.
"""
