"""The ipyparallel transport: a run's ranks on engines as the supervisor sees them.

Each rank is one ``apply_async`` of ``worker.engine.run_rank`` on its engine: rank 0's first; the
others once rank 0 says where its store listens (a ``meeting`` event). Its events arrive as
ipyparallel data messages, its output as the call's streams, its outcome as the call's value.
Each rank says it is alive every second. On several hosts a rank a peer reports cut off is lost
(its host dropped off the network), and so is one the cluster drops after it fell silent. Stack
dumps arrive as events too, and are written to the run directory's stack files.
Requests are signals sent through ipyparallel (SIGUSR2 = please stop, SIGINT = interrupt,
STACK_SIGNAL = dump stacks). An engine is the user's process, never ours to kill: one that does not
stop after an interrupt is reported and left running. A session's requests (its cells, a ping)
are frames the notebook puts in a store it hosts, under each rank's next key
(``worker.channel.request_key``), cut in parts the store holds; each rank reads its own in order.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from ...core.events import Control, EventKind, RankConfig, encode
from ...core.failures import FailureKind, Phase
from ...core.rundir import RunDir
from ...transfer.loading import Received
from ...worker.boot import STACK_SIGNAL
from ...worker.channel import request_key
from ...worker.engine import run_rank
from ...worker.meeting import Meeting
from ..base import Exited, Observation, Output, Transport, WorkerEvent
from .engines import Engines

__all__ = ["EngineTransport"]

_SETTLE = 2.0  # seconds to wait for every outcome before the cause is named (a death is seen late)
_POLL = 0.05  # data messages are not a file to wait on: look this often
_POLL_SESSION = 0.005  # ... and this often for a session's ranks, whose answers a user waits for
_DEATH_SEEN_WITHIN = 3.0  # seconds: a rank silent longer before its engine "died" was cut off first
_PART = 4 * 1024 * 1024  # bytes of a request frame per store value (a store value holds 8 MiB at most)


class EngineTransport(Transport):
    """Watches the calls of a run's ranks until each has ended (or been given up on)."""

    def __init__(self, engines: Engines, configs: Sequence[RankConfig], payload: bytes, directory: RunDir,
                 hosts: Sequence[str], network_timeout: Optional[float] = None,
                 requests: Optional[Meeting] = None) -> None:
        self.engines = engines
        self.requests = requests  # a session's: the store its ranks read the notebook's requests from
        self._sent = [0] * len(configs)  # per rank: the frames put in the store so far
        self._send_lock = threading.Lock()
        self.configs = list(configs)
        self.payload = payload
        self.directory = directory
        self.hosts = list(hosts)
        self.network_timeout = network_timeout  # None: one host, silence is not a network failure
        self._ars: dict[int, Any] = {}
        self._ended: set[int] = set()
        self._out_pos: dict[tuple[int, str], int] = {}
        self._pids: dict[int, int] = {}  # ranks whose function started (they have our handlers)
        self._heard: dict[int, float] = {}  # rank -> when it was last heard from
        self._interrupted: dict[int, float] = {}  # rank -> when it was first interrupted
        self._given_up: list[Observation] = []
        self._wake = threading.Event()
        self._submit(0)

    def _submit(self, rank: int) -> None:
        ar = self.engines.client[self.engines.ids[rank]].apply_async(run_rank, self.configs[rank], self.payload)
        ar.add_done_callback(lambda _f: self._wake.set())
        self._ars[rank] = ar
        self._heard[rank] = time.monotonic()

    def _where(self, rank: int) -> str:
        return f"host {self.hosts[rank]} (engine {self.engines.ids[rank]})"

    # ---- what happened ------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[Observation]:
        self._wake.wait(min(timeout, _POLL if self.requests is None else _POLL_SESSION))
        self._wake.clear()
        out, self._given_up = self._given_up, []
        for rank, ar in list(self._ars.items()):
            if rank in self._ended:
                continue
            self._pump(rank, out)
            if ar.ready() and rank not in self._ended:
                self._end(rank, out)
        return out

    def _lose(self, rank: int, why: str, out: list[Observation]) -> None:
        if rank in self._ended:
            return
        self._ended.add(rank)
        out.append(Exited(rank, pid=self._pids.get(rank), lost=why, lost_kind=FailureKind.NETWORK))

    def settle(self, silent: Sequence[int]) -> list[Observation]:
        # A dead engine is noticed by the cluster a moment after the peers that it left in a
        # collective report their knock-on errors: wait briefly for every outcome. A session's
        # ranks live on after a cell's error: the supervisor pings them instead (a dead engine
        # cannot answer), so only what has come is taken.
        out = self.poll(0.0)
        if self.requests is not None:
            return out
        deadline = time.monotonic() + _SETTLE
        while time.monotonic() < deadline and len(self._ended) < len(self._ars):
            out += self.poll(_POLL)
        return out

    def _pump(self, rank: int, out: list[Observation]) -> None:
        """Events the engine published, and what it printed, since the last look."""
        ar = self._ars[rank]
        data = ar.data
        for key in sorted(data):
            event = dict(data.pop(key), rank=rank)
            self._heard[rank] = time.monotonic()
            kind = event.get("kind")
            if kind == EventKind.ALIVE:
                continue
            blob = event.pop("blob", None)
            if isinstance(blob, bytes):  # a session's answer: its pickled part
                out.append(WorkerEvent(rank, dict(event, blob=len(blob)), Received(blob)))
                continue
            if kind == EventKind.STACKS:
                self._keep_stacks(rank, event)
                continue
            if kind == EventKind.MEETING:  # rank 0's store listens: the others may start
                for other in range(1, len(self.configs)):
                    if other not in self._ended:
                        self.configs[other]["meeting"]["port"] = event.get("port")
                        self._submit(other)
                continue
            if kind == EventKind.STARTED and event.get("pid") is not None:
                self._pids[rank] = event["pid"]
            if kind == EventKind.CHECKPOINT and "data" in event:
                self._keep_checkpoint(event)
            out.append(WorkerEvent(rank, event))
        for stream in ("stdout", "stderr"):
            text = getattr(ar, stream) or ""
            pos = self._out_pos.get((rank, stream), 0)
            if len(text) > pos:
                self._out_pos[(rank, stream)] = len(text)
                self._heard[rank] = time.monotonic()
                out.append(Output(rank, stream, text[pos:]))

    def _keep_checkpoint(self, event: dict[str, Any]) -> None:
        """A checkpoint an engine saved: written into the run directory, as a local rank would have."""
        data = event.pop("data")
        try:
            event["path"] = self.directory.save_checkpoint(int(event["epoch"]), lambda f: f.write(data),
                                                           keep=event.get("keep"), best=bool(event.get("best")))
        except (OSError, TypeError, ValueError, KeyError) as e:
            event["error"] = f"the checkpoint could not be written: {e}"

    def _keep_stacks(self, rank: int, event: dict[str, Any]) -> None:
        """A rank's stack dump, into its stack file in the run directory (the watchdog reads it)."""
        try:
            self.directory.append_private(self.directory.stack_file(rank), str(event.get("text", "")))
        except OSError:
            pass

    def _end(self, rank: int, out: list[Observation]) -> None:
        """The call of ``rank`` has ended: its outcome, then its exit."""
        self._ended.add(rank)
        ar = self._ars[rank]
        ar.wait_for_output(1.0)  # the data and output that travelled beside the result
        self._pump(rank, out)
        pid = self._pids.get(rank)
        try:
            outcome = ar.get(0)
        except Exception as e:  # noqa: BLE001 - ipyparallel's RemoteError / EngineError
            out.extend(self._lost(rank, e))
            return
        if outcome.get("kind") == EventKind.DONE:
            out.append(WorkerEvent(rank, {"kind": EventKind.DONE, "time": outcome.get("time", time.time()),
                                          "rank": rank}, Received(outcome["blob"]) if outcome.get("blob") is not None
                                      else None))
            out.append(Exited(rank, code=0, pid=pid))
        else:
            # A rank whose collective failed because it lost a peer's host: that host is the cause.
            for peer, why in dict(outcome.get("unreachable") or {}).items():
                if int(peer) in self._ars:
                    self._lose(int(peer), f"{self._where(int(peer))} stopped answering worker {rank} ({why})", out)
            out.append(WorkerEvent(rank, dict(outcome, rank=rank)))
            out.append(Exited(rank, code=1, pid=pid))

    def _lost(self, rank: int, error: Exception) -> list[Observation]:
        """The call raised in the notebook: the engine died, or could not even start the call."""
        ename = getattr(error, "ename", type(error).__name__)
        eid = self.engines.ids[rank]
        pid = self._pids.get(rank)
        if ename == "EngineError":
            # The cluster also drops an engine whose heartbeats stopped (its host cut off): on several
            # hosts, one silent for a while before that is lost to the network, not dead. A death is
            # reported at once by the engine's nanny, within a beat of the rank's last word.
            # A rank whose call never started (cut off before it arrived) was silent since it was sent.
            silent = time.monotonic() - self._heard.get(rank, time.monotonic())
            if self.network_timeout is not None and silent > _DEATH_SEEN_WITHIN:
                since = "" if rank in self._pids else " since its call was sent"
                why = (f"{self._where(rank)} was not heard from{since} for {silent:.0f} s, then the cluster dropped "
                       "its engine")
                return [Exited(rank, pid=pid, lost=why, lost_kind=FailureKind.NETWORK)]
            return [Exited(rank, pid=pid, lost=f"engine {eid} died")]
        evalue = getattr(error, "evalue", str(error))
        # Our own interrupt takes a queued call out of the engine's queue: that is a stop.
        event = {"kind": EventKind.ERROR, "rank": rank, "time": time.time(), "phase": Phase.STARTUP,
                 "exc_type": ename, "message": f"engine {eid} could not start the call: {evalue}",
                 "traceback": str(getattr(error, "traceback", "") or ""), "interrupted": rank in self._interrupted}
        return [WorkerEvent(rank, event), Exited(rank, code=None, pid=pid)]

    # ---- requests -------------------------------------------------------------------------------
    def wake(self) -> None:
        self._wake.set()

    def send(self, ranks: Sequence[int], request: dict[str, Any], body: Optional[bytes] = None,
             give_up: Optional[Callable[[], bool]] = None) -> list[int]:
        if self.requests is None:
            return super().send(ranks, request, body, give_up)
        return self._put(ranks, encode(dict(request, kind=Control.REQUEST), body))

    def _put(self, ranks: Sequence[int], frame: bytes, ended_too: bool = False) -> list[int]:
        """Put ``frame`` under each rank's next key (its parts first, their count last: a rank
        reads the count, then the parts); the ranks it could not reach."""
        parts = [frame[i:i + _PART] for i in range(0, len(frame), _PART)] or [b""]
        missed = []
        with self._send_lock:
            for rank in ranks:
                if (rank in self._ended and not ended_too) or self.requests is None:
                    missed.append(rank)
                    continue
                key = request_key(rank, self._sent[rank])
                try:
                    for i, part in enumerate(parts):
                        self.requests.store.set(f"{key}/{i}", part)
                    self.requests.store.set(key, str(len(parts)))
                except Exception:  # noqa: BLE001 - DistNetworkError: the store is closed
                    missed.append(rank)
                    continue
                self._sent[rank] += 1
        return missed

    def _signal(self, sig: int, ranks: Sequence[int]) -> None:
        """Signal the engines of ``ranks`` that run our function. A rank not started yet (its
        engine may still run another task, and has none of our handlers) gets no signal; an
        interrupt takes its call out of the engine's queue instead."""
        ranks = [r for r in ranks if r not in self._ended]
        started = [r for r in ranks if r in self._pids]
        if sig == signal.SIGINT:
            for r in ranks:
                if r not in self._ars:  # never submitted (rank 0's store was not up yet): nothing runs
                    self._ended.add(r)
                    self._given_up.append(Exited(r))
                    self._wake.set()
            ranks = [r for r in ranks if r in self._ars]
            for r in ranks:
                if r not in started:
                    try:
                        self._ars[r].abort()
                    except Exception:  # noqa: BLE001 - it started meanwhile: its peers' end ends it
                        pass
        if not started:
            return
        try:
            self.engines.client.send_signal(sig, targets=[self.engines.ids[r] for r in started], block=False)
        except Exception:  # noqa: BLE001 - an engine that is gone needs no signal
            pass

    def request_stop(self, ranks: Sequence[int]) -> None:
        self._signal(signal.SIGUSR2, ranks)

    def interrupt(self, ranks: Sequence[int]) -> None:
        now = time.monotonic()
        for r in ranks:
            self._interrupted.setdefault(r, now)
        if self.requests is not None:  # a session's rank ignores a SIGINT it was not told to leave on
            self._put(ranks, encode({"kind": Control.REQUEST, "op": "leave"}))
        self._signal(signal.SIGINT, ranks)

    def kill(self, ranks: Sequence[int]) -> None:
        for rank in ranks:
            if rank in self._ended:
                continue
            # Not ours to kill: say so, and stop waiting for it.
            self._ended.add(rank)
            waited = time.monotonic() - self._interrupted.get(rank, time.monotonic())
            self._given_up += [
                Output(rank, "stderr", f"ddp_notebook: engine {self.engines.ids[rank]} did not stop within "
                                       f"{waited:.0f} s of an interrupt and still runs the function; interrupt or "
                                       "restart that engine before its next task.\n"),
                Exited(rank, pid=self._pids.get(rank))]
        self._wake.set()

    def request_stacks(self, ranks: Sequence[int]) -> None:
        """Signal ``ranks``; their dumps come back as events (the engines may be on other hosts):
        take them into the stack files now, within a couple of seconds, for the watchdog."""
        self._signal(STACK_SIGNAL, ranks)
        waiting = {r for r in ranks if r in self._pids and r not in self._ended}
        deadline = time.monotonic() + 2.0
        while waiting and time.monotonic() < deadline:
            for rank in list(waiting):
                data = self._ars[rank].data
                for key in sorted(data):
                    if data[key].get("kind") == EventKind.STACKS:
                        self._keep_stacks(rank, data.pop(key))
                        waiting.discard(rank)
            time.sleep(0.02)

    def abandon(self) -> None:
        self.interrupt([r for r in range(len(self.configs)) if r not in self._ended])

    def close(self) -> None:
        """Free the request store (its readers on the engines told to stop first); the engines
        are the cluster's."""
        if self.requests is not None:
            # Every rank's reader stops reading, a rank's whose call ended too.
            self._put(range(len(self.configs)), encode({"kind": Control.RELEASE}), ended_too=True)
            with self._send_lock:
                self.requests.close()
                self.requests = None
