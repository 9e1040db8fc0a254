"""The local executor: one new worker process per rank on this machine, for each run.

Owns: the executor (``executor``: validation on this machine, loopback-only networking, threads
per worker, and ``RankStarter``, which gets a run's processes on its own thread), the fork server
that forks each run's workers (``forkserver``: requests polled, never waited on; ``forked``: a
forked worker's handle and what makes a server stale), worker processes and their pipes, forked
or fresh interpreters (``processes``), the one long-lived thread that starts interpreters
(``spawner``: a worker dies with the thread that started it), the transport the supervisor
drives (``transport``: a selector over every pipe and pidfd) and the CUDA-safe probe of this
machine's GPUs (``gpu_probe``: a child process answers).
"""
