"""The meeting point of a run's ranks for code that sets up its own process group: a TCPStore
the notebook serves on a loopback socket, from each start of a run until it ends, named by the
workers' ``MASTER_ADDR`` / ``MASTER_PORT`` (the torchrun convention frameworks read).

``spawn``'s functions call ``init_process_group`` themselves; under ``launch`` the group is set
up already, and a framework that makes its own (after destroying ours) meets here too. Every
rank joins as a client (``worker.spawn_store``), as under torchrun's agent.

Example::

    env, close = loopback_store(2)   # {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41234", ...}
    close()
"""
from __future__ import annotations

import socket
import sys
from collections.abc import Callable
from datetime import timedelta

from ..core.events import SPAWN_STORE_ENV

__all__ = ["loopback_store"]


def loopback_store(world_size: int, needed: bool = True) -> tuple[dict[str, str], Callable[[], None]]:
    """The rendezvous of one start of a run: a TCPStore served by the notebook on a loopback
    socket bound and listening before its port is known to anyone (torch's own env:// rendezvous
    picks a port, releases it, then binds it on every interface). The workers' environment points
    every rank at it as a client; the returned function ends it. Unless ``needed``, a notebook
    that has not imported torch serves none (importing it would cost a second or more)."""
    if not needed and "torch" not in sys.modules:
        return {}, _nothing
    import torch.distributed as dist

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(max(128, world_size))
    port = sock.getsockname()[1]
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size, True, timeout=timedelta(minutes=30),
                              wait_for_workers=False, master_listen_fd=sock.fileno(), use_libuv=True)
    except (TypeError, RuntimeError):  # an older torch without master_listen_fd: rank 0 serves it, as before
        try:
            sock.close()
        except OSError:
            pass
        return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}, _nothing
    sock.detach()  # the store owns the socket now
    held = [store]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), SPAWN_STORE_ENV: f"127.0.0.1:{port}"}
    return env, held.clear  # the last reference: the store stops serving


def _nothing() -> None:
    pass
