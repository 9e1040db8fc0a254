"""Live progress from the training frameworks' own loops, with no change to the user's code.

Owns: the import hooks that patch a framework as a worker loads it (``hooks``), the reporters
(``lightning``, ``transformers``, ``steps``) and what they share (``reporting``: the switch,
plain metrics, patching a class once), and a framework's own notebook launcher called in a
worker (``launchers``: the function runs on the rank).

A worker watches its imports (``hooks.watch_imports``, before the call is unpickled): once
PyTorch Lightning's ``Trainer`` or ``Fabric``, Hugging Face's ``Trainer`` or accelerate's
``Accelerator`` is loaded, the class is patched so that every instance made in this rank reports
to the rank's context (``ctx.log``): the step, the total and epoch where the framework knows
them, the loss and the metrics it logs. They then show in the panel like any ``ctx.log``.

- ``lightning``: a Lightning ``Callback`` added to every ``Trainer``;
- ``transformers``: a ``TrainerCallback`` added to every Hugging Face ``Trainer``;
- ``steps``: ``Fabric`` and ``Accelerator`` have no loop of their own: each ``backward`` is a
  step, and what the code gives ``log`` / ``log_dict`` goes to the panel too.

``DDP_NOTEBOOK_FRAMEWORK_PROGRESS=0`` (in the notebook, or in a launch's ``env=``) turns it off.
The same callbacks are offered for explicit use as ``ddp_notebook.integrations.<framework>``.
Nothing here imports a framework: it is patched only once the user's code has imported it.
"""
