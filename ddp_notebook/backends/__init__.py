"""Backends: where the ranks of a run execute, beneath one supervision core.

Owns: the contract (``base``: a ``Backend`` places and validates a run and starts a
``Transport``, the small surface the supervisor drives: start, poll, signal, stacks, close),
and its two implementations: ``local`` (one fresh worker process per rank, pipes, pidfd, a warm
pool) and ``ipyparallel`` (one rank per engine of a cluster).

May import: ``ddp_notebook.core`` and ``ddp_notebook.worker`` (what runs in a rank). Never the
engine or a front end: the engine picks a backend, not the other way round.
"""
