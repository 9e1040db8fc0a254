"""The notebook's end of a session's sockets: one Unix socket in an owner-only folder (only this
user's processes can connect), a secret token each rank's first frame must carry, and each rank's
connection accepted as its run starts (``lifecycle.session`` forms the session with it).
"""
from __future__ import annotations

import os
import secrets
import select
import shutil
import socket
import tempfile
from collections.abc import Callable
from typing import Any

from ..transfer import pickling
from ..worker.session_loop import FrameReader

__all__ = ["RankListener", "close_all"]

_POLL = 0.1
_HELLO_BYTES = 4096  # a rank's first frame is small: anything larger is no rank of this session
_HELLO_WAIT = 30.0  # seconds a connection gets to say who it is


def close_all(connections: dict[int, socket.socket]) -> None:
    """Close every rank's connection (its rank reads the end and leaves its loop)."""
    for conn in connections.values():
        try:
            conn.close()
        except OSError:
            pass
    connections.clear()


class RankListener:
    """Where a session's ranks connect: ``address`` and ``token`` go to each rank; ``accept``
    takes their connections; ``close`` removes the socket and its folder."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="ddp-session-")  # owner-only: only this user's processes connect
        self.address = os.path.join(self.folder, "s")
        self.token = secrets.token_hex(16)
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.bind(self.address)
            self.sock.listen(64)
        except BaseException:
            self.close()
            raise

    def accept(self, world: int, ended: Callable[[], bool], connections: dict[int, socket.socket],
               readers: dict[int, FrameReader], pids: dict[int, int]) -> bool:
        """Take the connections of ranks 0 to ``world - 1`` (a connection that does not say this
        session's token first is closed), until every rank has connected (True) or ``ended()``
        (False: the run ended first)."""
        while len(connections) < world:
            if ended():
                return False
            ready, _, _ = select.select([self.sock], [], [], _POLL)
            if not ready:
                continue
            conn, _ = self.sock.accept()
            reader = FrameReader()
            hello = self._hello(conn, reader)
            if hello.get("op") != "hello" or hello.get("token") != self.token or not isinstance(hello.get("rank"), int):
                conn.close()  # not one of this session's ranks
                continue
            conn.settimeout(None)
            rank = hello["rank"]
            connections[rank], readers[rank], pids[rank] = conn, reader, hello.get("pid", 0)
        return True

    @staticmethod
    def _hello(conn: socket.socket, reader: FrameReader) -> dict[str, Any]:
        conn.settimeout(_HELLO_WAIT)
        try:
            while True:
                data = conn.recv(1 << 16)
                if not data:
                    return {}
                reader.feed(data)
                frames = reader.frames()
                if frames:
                    hello = pickling.loads(frames[0]) if len(frames[0]) < _HELLO_BYTES else {}
                    return hello if isinstance(hello, dict) else {}
        except OSError:
            return {}

    def close(self) -> None:
        """Stop listening and remove the socket's folder (connections taken stay open)."""
        self.sock.close()
        shutil.rmtree(self.folder, ignore_errors=True)
