"""The meeting point of a run's ranks for code that sets up its own process group: a TCPStore
the notebook serves on a loopback socket, from each start of a run until it ends, named by the
workers' ``MASTER_ADDR`` / ``MASTER_PORT`` (the torchrun convention frameworks read).

``spawn``'s functions call ``init_process_group`` themselves; under ``launch`` the group is set
up already, and a framework that makes its own (after destroying ours) meets here too. Every
rank joins as a client (``worker.spawn_store``), as under torchrun's agent.

The socket is bound and listening at once (its port goes into the workers' environment); the
store itself starts serving on it once the ranks are asked for (``serve``): a rank that connects
before waits in the socket's backlog, and the fork requests leave without waiting for the store's
own threads to start (1-2 ms of every launch on two busy cores).

Example::

    store = LoopbackStore(2)   # store.env: {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "41234", ...}
    store.serve()
    store.close()
"""
from __future__ import annotations

import logging
import socket
import sys
from datetime import timedelta
from typing import Any, Optional

from ..core.events import SPAWN_STORE_ENV

__all__ = ["LoopbackStore"]

log = logging.getLogger(__name__)


class LoopbackStore:
    """The rendezvous of one start of a run: a TCPStore served by the notebook on a loopback
    socket bound and listening before its port is known to anyone (torch's own env:// rendezvous
    picks a port, releases it, then binds it on every interface). ``env`` points every rank at it
    as a client; ``serve`` starts the store, ``close`` ends it. Unless ``needed``, a notebook
    that has not imported torch serves none (importing it would cost a second or more): ``env``
    is empty."""

    def __init__(self, world_size: int, needed: bool = True) -> None:
        self.env: dict[str, str] = {}
        self._world_size = world_size
        self._sock: Optional[socket.socket] = None
        self._store: Any = None
        if not needed and "torch" not in sys.modules:
            return
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.bind(("127.0.0.1", 0))
            sock.listen(max(128, world_size))
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        port = sock.getsockname()[1]
        self.env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), SPAWN_STORE_ENV: f"127.0.0.1:{port}"}

    def serve(self) -> None:
        """Serve the store on the socket (once). A store that cannot be made is logged and its
        socket closed: a rank that meets there is refused and raises, named as any rank's error."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        try:
            import torch.distributed as dist

            self._store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], self._world_size, True,
                                        timeout=timedelta(minutes=30), wait_for_workers=False,
                                        master_listen_fd=sock.fileno(), use_libuv=True)
        except Exception:  # the ranks are on their way: said, never raised into the start
            log.warning("the run's loopback TCPStore could not be served", exc_info=True)
            sock.close()
            return
        sock.detach()  # the store owns the socket now

    def close(self) -> None:
        """Stop serving (the store's last reference goes), or close the socket never served."""
        sock, self._sock, self._store = self._sock, None, None
        if sock is not None:
            sock.close()
