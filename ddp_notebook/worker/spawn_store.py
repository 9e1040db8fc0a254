"""Spawn mode: the function's own ``env://`` (or ``tcp://``) rendezvous joins the TCPStore the
notebook serves on loopback (``lifecycle.store.LoopbackStore``) as a client, as every rank does
under torchrun's agent.

Ranks on engines (which may be on several hosts) meet in rank 0's store instead (``meeting``):
``MASTER_ADDR`` / ``MASTER_PORT`` name it, and the function's keys live under the run's secret.

Only a rendezvous on the notebook's port is redirected: code that sets its own ``MASTER_PORT``
(PyTorch's tutorial assigns ``12355``) keeps torch's behaviour, rank 0 serving the store, which
a blanket ``TORCHELASTIC_USE_AGENT_STORE`` would have turned into every rank waiting for a
server that never comes.
"""
from __future__ import annotations

import importlib
import os
from datetime import timedelta
from typing import Any, Optional

from ..core.events import SPAWN_STORE_ENV
from .meeting import Meeting

__all__ = ["join_notebook_store"]


def join_notebook_store(meeting: Optional[Meeting] = None) -> None:
    """Make this rank's rendezvous on the notebook's store (or on the ``meeting`` of ranks on
    engines) a client of it (before ``fn`` runs)."""
    where = os.environ.pop(SPAWN_STORE_ENV, None)
    if not where:
        return
    host, port = where.rsplit(":", 1)
    if meeting is not None:
        host, port = meeting.address, str(meeting.port)
        os.environ.update(MASTER_ADDR=host, MASTER_PORT=port)
    from torch.distributed import PrefixStore, TCPStore

    # The module (torch.distributed.rendezvous is also the name of a function it exports).
    rendezvous = importlib.import_module("torch.distributed.rendezvous")
    original = getattr(rendezvous, "_create_c10d_store", None)
    if original is None:  # another torch: every rank a client, torch's own switch for it
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        return

    def create_store(hostname: str, port_: int, rank: int, world_size: int, timeout: timedelta,
                     *args: Any, **kwargs: Any) -> Any:
        if int(port_) == int(port):
            store = TCPStore(host, int(port), world_size, False, timeout=timeout)
            return store if meeting is None else PrefixStore(f"{meeting.secret}/spawn/", store)
        return original(hostname, port_, rank, world_size, timeout, *args, **kwargs)

    setattr(rendezvous, "_create_c10d_store", create_store)  # noqa: B010 - a private hook of torch
