"""A rank's pulse on an engine: a thread that, while the rank's call runs,

- tells the notebook it is alive (an ``alive`` event every ``BEAT`` seconds: a host whose link
  is gone falls silent, and the notebook names it);
- forwards what the rank's faulthandler dumped into its local stack file (``stacks`` events:
  the notebook may be on another host, with no shared file system);
- on several hosts, beats in the run's store and watches its peers' beats: a peer silent for
  ``network_timeout`` seconds (or rank 0's store, for the others) is taken as cut off, and this
  rank's connections to it are shut down (``network.cut_off``), so a collective blocked on it
  fails now. ``unreachable`` then names the ranks, for the error event.

    pulse = Pulse(rank, world_size, send, stack_path, network_timeout=10.0)
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
from .network import cut_off

__all__ = ["Pulse", "BEAT"]

BEAT = 1.0  # seconds between two beats
_LOOK = 0.05  # seconds between two looks at the stack file


class Pulse:
    def __init__(self, rank: int, world_size: int, send: Callable[[dict[str, Any]], None], stack_path: str,
                 network_timeout: Optional[float] = None) -> None:
        self.rank, self.world_size, self.send = rank, world_size, send
        self.stack_path = stack_path
        self.meeting: Optional[Meeting] = None
        self.network_timeout = network_timeout or 0.0
        self.unreachable: dict[int, str] = {}  # rank -> why, once taken as cut off
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddp-pulse", daemon=True)
        self._stack_pos = 0
        self._beats: dict[int, tuple[int, float]] = {}  # peer -> (its last count, when it changed)
        self._store_ok = time.monotonic()
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
        self._store_ok = time.monotonic()
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
                if self.meeting is not None and not self.unreachable:
                    self._beat(now)

    def _forward_stacks(self) -> None:
        """Send what the stack file gained, once it stops growing (faulthandler writes from a
        signal handler, asynchronously)."""
        try:
            size = os.path.getsize(self.stack_path)
        except OSError:
            return
        if size <= self._stack_pos:
            return
        time.sleep(_LOOK)
        if os.path.getsize(self.stack_path) != size:
            return  # still being written: next look
        with open(self.stack_path, "rb") as f:
            f.seek(self._stack_pos)
            text = f.read(size - self._stack_pos).decode(errors="replace")
        self._stack_pos = size
        try:
            self.send({"kind": EventKind.STACKS, "text": text})
        except Exception:  # noqa: BLE001
            pass

    def _beat(self, now: float) -> None:
        assert self.meeting is not None
        try:
            store = self._beater
            store.add(f"beat/{self.rank}", 1)
            counts = {r: store.add(f"beat/{r}", 0) for r in range(self.world_size) if r != self.rank}
            self._store_ok = now
        except Exception:  # noqa: BLE001 - rank 0's store (its host) does not answer
            if self.rank != 0 and now - self._store_ok > self.network_timeout:
                self._lose({0: f"its store did not answer for {now - self._store_ok:.0f} s"})
            return
        lost = {}
        for r, count in counts.items():
            last = self._beats.get(r)
            if last is None or count != last[0]:
                self._beats[r] = (count, now)
            elif now - last[1] > self.network_timeout:
                lost[r] = f"no beat for {now - last[1]:.0f} s"
        if lost:
            self._lose(lost)

    def _lose(self, lost: dict[int, str]) -> None:
        """Take ``lost`` as cut off: release what waits on them (every connection to their host)."""
        self.unreachable.update(lost)
        cut_off({self._addresses[r] for r in lost if r in self._addresses})
