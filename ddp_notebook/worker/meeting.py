"""Where the ranks of a run on ipyparallel engines meet, with no shared file system.

Rank 0's call hosts a TCPStore on the address its peers reach (validation found it, see
``network``), bound to that address only and for the call's life; its port reaches the notebook
in a ``meeting`` event, and the notebook starts the other ranks' calls with it. Through the store
the ranks set up the process group, meet in Python before and after the function (``arrive``:
where an interrupt is still seen, since an engine cannot be killed), mark the run ended when one
fails, and beat (``pulse``) so a host that drops off is noticed.

Every key is under the run's secret (a ``PrefixStore``): the store authenticates no connection
(torch's does not), but a host on the network that connects without the secret cannot read or
write any of the run's keys. The secret travels in the call, through ipyparallel.

    meeting = Meeting.host("10.0.0.11", secret, timeout=1800)      # rank 0
    meeting = Meeting.join("10.0.0.11", port, secret, timeout=1800)  # the others
    meeting.arrive("arrived", rank, world_size)

The address is IPv4 or IPv6 (``fd00::11``), unbracketed: torch's ``TCPStore`` resolves its host
string, and a bracketed IPv6 address is no name it can resolve.
"""
from __future__ import annotations

import socket
import time
from datetime import timedelta
from typing import Any, Optional

from .network import family_of, normalised, shown

__all__ = ["Meeting", "RunEndedError", "CONNECT_SECONDS"]

CONNECT_SECONDS = 60.0  # how long a rank tries to reach rank 0's store (it exists before the rank starts)


class RunEndedError(RuntimeError):
    """The run ended (a peer failed, or its store is gone) while this rank waited for its peers:
    a knock-on, never a cause."""


class Meeting:
    """A run's store, as one rank holds it (``host``: rank 0 serves it; ``join``: a client)."""

    def __init__(self, raw: Any, address: str, port: int, secret: str, timeout: float, serves: bool) -> None:
        import torch.distributed as dist

        self.raw = raw
        self.address, self.port, self.secret, self.timeout, self.serves = address, port, secret, timeout, serves
        self.store: Any = dist.PrefixStore(f"{secret}/", raw)

    @classmethod
    def host(cls, address: str, secret: str, timeout: float) -> Meeting:
        """Serve the run's store on ``address`` (a port the system picks, bound before anyone
        can learn it)."""
        import torch.distributed as dist

        address = normalised(address)
        sock = socket.socket(family_of(address), socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((address, 0))
            sock.listen(128)
        except OSError:
            sock.close()
            raise
        port = sock.getsockname()[1]
        raw = dist.TCPStore(address, port, None, True, timeout=timedelta(seconds=timeout), wait_for_workers=False,
                            master_listen_fd=sock.fileno(), use_libuv=True)
        sock.detach()  # the store owns the socket now
        return cls(raw, address, port, secret, timeout, serves=True)

    @classmethod
    def join(cls, address: str, port: int, secret: str, timeout: float,
             connect: float = CONNECT_SECONDS, host: str = "rank 0's engine") -> Meeting:
        """Connect to rank 0's store (or another's, on ``host``: the notebook's, for a session's
        requests); ``RunEndedError`` when it is gone (rank 0 ended)."""
        raw = cls.client(address, port, connect, host)
        raw.set_timeout(timedelta(seconds=timeout))
        return cls(raw, address, port, secret, timeout, serves=False)

    @staticmethod
    def client(address: str, port: int, timeout: float, host: str = "rank 0's engine") -> Any:
        import torch.distributed as dist

        try:
            return dist.TCPStore(normalised(address), port, None, False, timeout=timedelta(seconds=timeout))
        except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
            raise RunEndedError(f"the run's store at {shown(address, port)} ({host}) cannot be reached: "
                                f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None

    def beater(self, timeout: float) -> Any:
        """Another connection to the store, whose calls give up after ``timeout`` seconds (the
        pulse's: it must notice a dead link, where the group's own waits for the group's timeout)."""
        import torch.distributed as dist

        return dist.PrefixStore(f"{self.secret}/", self.client(self.address, self.port, timeout))

    def group_store(self) -> Any:
        """The store ``init_process_group`` meets in."""
        import torch.distributed as dist

        return dist.PrefixStore("group/", self.store)

    def arrive(self, stage: str, rank: int, world_size: int, timeout: Optional[float] = None) -> None:
        """Say that ``rank`` reached ``stage`` and wait until every rank has. Raises
        ``RunEndedError`` when the run ended meanwhile (or the store is gone), ``TimeoutError``
        after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout if timeout else None
        try:
            self.store.add(stage, 1)
            while self.store.add(stage, 0) < world_size:
                if self.store.check(["ended"]):
                    raise RunEndedError("the run ended before every rank got this far")
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"not every rank got this far within {timeout:.0f} s")
                time.sleep(0.01)
        except RuntimeError as e:
            if isinstance(e, RunEndedError):
                raise
            raise RunEndedError(f"the run's store (rank 0's engine) is gone: {str(e).splitlines()[0]}") from None

    def end(self) -> None:
        """Mark the run ended: peers waiting in ``arrive`` leave. Never raises."""
        try:
            self.store.set("ended", "1")
        except Exception:  # noqa: BLE001 - the store is gone: so is every wait on it
            pass

    def close(self) -> None:
        self.store = self.raw = None  # the last references: a host's store stops serving
