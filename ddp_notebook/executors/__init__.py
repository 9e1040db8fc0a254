"""Executors: where the ranks of a run execute, beneath one supervision core.

Owns: the contract (``base``: an ``Executor`` places and validates a run and starts a
``Transport``, the small surface the supervisor drives: poll, settle, stop, interrupt, kill,
stacks, close), and its two implementations: ``local`` (one new worker process per rank on this
machine, forked by the fork server) and ``ipyparallel`` (one rank per engine of a cluster).

("Executor", not "backend": the backend of a run is its torch.distributed backend, gloo or nccl.)

May import: ``ddp_notebook.core``, ``ddp_notebook.transfer`` and ``ddp_notebook.worker`` (what
runs in a rank). Never the lifecycle or a front end: the lifecycle picks an executor, not the
other way round.
"""
