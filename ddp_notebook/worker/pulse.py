"""A rank's pulse on an engine: a thread that, while the rank's call runs,

- tells the notebook it is alive (an ``alive`` event every ``BEAT`` seconds: a host whose link
  is gone falls silent, and the notebook names it);
- forwards what the rank's faulthandler dumped into its local stack file, read through a file
  descriptor (``stacks`` events: the notebook may be on another host, with no shared file system);
- on several hosts, turns on TCP keepalive on this rank's connections (IPv4 or IPv6) to its peers' hosts
  (``network.keep_alive``): the kernel, which answers for a peer whatever its Python does (a rank
  may hold the GIL for a minute), ends a connection whose other end stopped answering for about
  ``network_timeout`` seconds, so a collective blocked on a host cut off fails then, not after
  the group's timeout;
- beats in the run's store and watches its peers' beats, to name the cause when a collective
  fails that way: ``unreachable()`` gives the peers silent for half the timeout or more (for the
  others, rank 0 when its store does not answer).

    pulse = Pulse(rank, world_size, send, stacks_fd, network_timeout=10.0)
    pulse.start()
    pulse.watch(meeting)   # once every rank has arrived (their addresses are in the store)
    pulse.stop()
"""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from ..core.events import EventKind
from .meeting import Meeting
from .network import keep_alive

__all__ = ["Pulse", "BEAT"]

BEAT = 1.0  # seconds between two beats
_LOOK = 0.05  # seconds between two looks at the stack file


class Pulse:
    def __init__(self, rank: int, world_size: int, send: Callable[[dict[str, Any]], None], stacks: int,
                 network_timeout: Optional[float] = None) -> None:
        self.rank, self.world_size, self.send = rank, world_size, send
        self.stacks = stacks  # a descriptor of the stack file, open for reading
        self.meeting: Optional[Meeting] = None
        self.network_timeout = network_timeout or 0.0
        self._store_failing_since: Optional[float] = None
        self._kept_alive: set[int] = set()  # the socket inodes keepalive was turned on for
        self._gaps: dict[int, tuple[float, float]] = {}  # peer -> (its last long silence, when it ended)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddp-pulse", daemon=True)
        self._stack_pos = 0
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (its last count, when it changed)
        self._beater: Any = None
        self._addresses: dict[int, str] = {}  # rank -> the address its gloo pairs use

    def start(self) -> None:
        self._thread.start()

    def watch(self, meeting: Meeting) -> None:
        """Beat in ``meeting`` and watch the peers' beats from now on (only with a network
        timeout: ranks on several hosts)."""
        if not self.network_timeout:
            return
        self._beater = meeting.beater(min(self.network_timeout, 5.0))
        self._addresses = {r: self._beater.get(f"address/{r}").decode() for r in range(self.world_size)}
        self.meeting = meeting

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        next_beat = 0.0
        while not self._done.wait(_LOOK):
            self._forward_stacks()
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + BEAT
                try:
                    self.send({"kind": EventKind.ALIVE})
                except Exception:  # noqa: BLE001 - the notebook's side is gone: nothing to tell
                    pass
                if self.meeting is not None:
                    self._beat(now)

    def _forward_stacks(self) -> None:
        """Send what the stack file gained, once it stops growing (faulthandler writes from a
        signal handler, asynchronously)."""
        try:
            size = os.fstat(self.stacks).st_size
            if size <= self._stack_pos:
                return
            time.sleep(_LOOK)
            if os.fstat(self.stacks).st_size != size:
                return  # still being written: next look
            text = os.pread(self.stacks, size - self._stack_pos, self._stack_pos).decode(errors="replace")
        except OSError:
            return
        self._stack_pos = size
        try:
            self.send({"kind": EventKind.STACKS, "text": text})
        except Exception:  # noqa: BLE001
            pass

    def _beat(self, now: float) -> None:
        assert self.meeting is not None
        self._kept_alive |= keep_alive(set(self._addresses.values()), self.network_timeout, self._kept_alive)
        try:
            store = self._beater
            store.add(f"beat/{self.rank}", 1)
            counts = {r: store.add(f"beat/{r}", 0) for r in range(self.world_size) if r != self.rank}
            self._store_failing_since = None
        except Exception:  # noqa: BLE001 - rank 0's store (its host) does not answer
            if self._store_failing_since is None:
                self._store_failing_since = now
            return
        for r, count in counts.items():
            last = self._beats.get(r)
            if last is None or count != last[0]:
                if last is not None and now - last[1] >= self._silent_after():
                    self._gaps[r] = (now - last[1], now)  # silent a while, then back (a link that dropped)
                self._beats[r] = (count, now)

    def _silent_after(self) -> float:
        """Seconds without a beat that make a peer silent: half the timeout, and a few beats."""
        return max(self.network_timeout / 2, 3 * BEAT)

    def unreachable(self) -> dict[int, str]:
        """The peers silent for half the network timeout or more (the likely cause when a
        collective failed): ``{rank: why}``. Empty with one host."""
        if self.meeting is None:
            return {}
        now = time.monotonic()
        limit = self._silent_after()
        if self.rank != 0 and self._store_failing_since is not None and now - self._store_failing_since >= limit:
            return {0: f"its store did not answer for {now - self._store_failing_since:.0f} s"}
        out = {r: f"no beat for {now - since:.0f} s" for r, (_count, since) in self._beats.items()
               if now - since >= limit}
        for r, (gap, back) in self._gaps.items():  # a link back too late for the connections
            if r not in out and now - back <= 2 * self.network_timeout:
                out[r] = f"no beat for {gap:.0f} s, {now - back:.0f} s ago"
        return out
