"""The local backend: one new worker process per rank on this machine, for each run.

Owns: worker processes and their pipes (``processes``), the one long-lived thread that starts them
all (``spawner``: a worker dies with the thread that started it), the fork server that forks
each run's workers (``forkserver``), the warm pool of fresh interpreters (``pool``), the
transport the supervisor drives (``transport``: a selector over every pipe and pidfd) and the
backend (``backend``: validation on this machine, loopback-only networking, threads per worker).
"""
