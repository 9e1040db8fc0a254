"""How a worker process is started: what the local backend and ``process.main`` agree on.

The backend runs ``python -m ddp_notebook.worker.process`` with ``BOOT_ENV`` holding the numbers
of two inherited pipe ends (``event_fd`` to report, ``control_fd`` to hear) and whether the
process is pooled. The assignment (a ``RankConfig``) arrives as one frame on the control pipe.
"""
from __future__ import annotations

import signal

__all__ = ["MODULE", "BOOT_ENV", "EXIT_FAILED", "EXIT_ORPHANED", "STOP", "RELEASE", "FLUSH", "STACK_SIGNAL"]

MODULE = "ddp_notebook.worker.process"
BOOT_ENV = "DDP_NOTEBOOK_WORKER"
EXIT_FAILED = 1  # the rank reported an error
EXIT_ORPHANED = 75  # the notebook process went away
STOP = b"s"  # on the control pipe: the run asks the rank to stop (ctx.should_stop)
RELEASE = b"x"  # on the control pipe: every rank is done, leave
# The signal that makes a rank dump its stacks for the stall watchdog: a real-time signal where
# there is one, so user code that handles SIGUSR1 (a cluster's checkpoint-and-requeue handler) is
# never triggered by the watchdog, nor hides the dump.
STACK_SIGNAL = signal.SIGRTMIN + 3 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR1
FLUSH = b"f"  # on the control pipe: send the progress report held back by throttling, if any
