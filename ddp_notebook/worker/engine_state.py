"""What a rank changes in an ipyparallel engine, and giving it back.

An engine is a long-lived process that belongs to the user's cluster: unlike a worker process it
is not ours to end. So a rank takes an ``EngineSnapshot`` first and restores it at the end: the
process group destroyed, then environment, ``sys.path``, working directory, thread count and
current GPU as they were.
"""
from __future__ import annotations

import os
import sys

from . import context, own_init, teardown

__all__ = ["EngineSnapshot"]


class EngineSnapshot:
    """The engine's state before the rank (``restore`` brings it back)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.env, self.cwd, self.sys_path = dict(os.environ), os.getcwd(), list(sys.path)
        self.threads = torch.get_num_threads()
        self.had_group = dist.is_available() and dist.is_initialized()
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        """Give the engine back as it was; the process group goes first (destroying it is also
        what makes peers blocked in a collective fail at once). Never raises: the rank's result
        or error must still reach the notebook."""
        import torch

        if not self.had_group:
            try:
                teardown.release()
            except BaseException:  # noqa: BLE001 - a broken group is gone either way
                pass
        own_init.restore_own_init()
        context.set_current(None)
        os.environ.clear()
        os.environ.update(self.env)
        sys.path[:] = self.sys_path
        try:
            os.chdir(self.cwd)
        except OSError:
            pass
        torch.set_num_threads(self.threads)
        if self.cuda_device is not None:  # never create a CUDA context the engine did not have
            try:
                torch.cuda.set_device(self.cuda_device)
            except Exception:  # noqa: BLE001 - a broken device stays broken; the report matters more
                pass
