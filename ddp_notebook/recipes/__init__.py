"""Recipes: ready-made ways to use the lifecycle.

Owns: the built-in DDP ``fit`` (``fit`` on the notebook side: checks, preflight, the result;
``fit_loop`` on the worker side: the training loop every rank runs), ``spawn`` (existing
``torch.multiprocessing.spawn``-style code, unchanged) and the terminal ``demo``.

May import: ``ddp_notebook.lifecycle`` and ``ddp_notebook.core``. Never a front end.
"""
