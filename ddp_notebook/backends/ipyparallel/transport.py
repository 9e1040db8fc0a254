"""The ipyparallel transport: a run's ranks on engines as the supervisor sees them.

Each rank is one ``apply_async`` of ``worker.engine.run_rank`` on its engine. Its events arrive
as ipyparallel data messages, its output as the call's streams, its outcome as the call's value.
Requests are signals sent through ipyparallel (SIGUSR2 = please stop, SIGINT = interrupt,
STACK_SIGNAL = dump stacks). An engine is the user's process, never ours to kill: one that does not
stop after an interrupt is reported and left running.
"""
from __future__ import annotations

import signal
import threading
import time
from collections.abc import Sequence
from typing import Any

from ...core.events import EventKind, RankConfig
from ...core.failures import Phase
from ...core.rundir import RunDir
from ...core.shared_load import Received
from ...worker.boot import STACK_SIGNAL
from ...worker.engine import run_rank
from ..base import Exited, Observation, Output, Transport, WorkerEvent
from .engines import Engines

__all__ = ["EngineTransport"]

_SETTLE = 2.0  # seconds to wait for every outcome before the cause is named (a death is seen late)
_POLL = 0.05  # data messages are not a file to wait on: look this often


class EngineTransport(Transport):
    """Watches the calls of a run's ranks until each has ended (or been given up on)."""

    def __init__(self, engines: Engines, configs: Sequence[RankConfig], payload: bytes, directory: RunDir) -> None:
        self.engines = engines
        self.configs = list(configs)
        self.directory = directory
        self._ars: dict[int, Any] = {}
        self._ended: set[int] = set()
        self._out_pos: dict[tuple[int, str], int] = {}
        self._pids: dict[int, int] = {}  # ranks whose function started (they have our handlers)
        self._interrupted: dict[int, float] = {}  # rank -> when it was first interrupted
        self._given_up: list[Observation] = []
        self._wake = threading.Event()
        for rank, cfg in enumerate(self.configs):
            ar = engines.client[engines.ids[rank]].apply_async(run_rank, cfg, payload)
            ar.add_done_callback(lambda _f: self._wake.set())
            self._ars[rank] = ar

    # ---- what happened ------------------------------------------------------------------------
    def poll(self, timeout: float) -> list[Observation]:
        self._wake.wait(min(timeout, _POLL))
        self._wake.clear()
        out, self._given_up = self._given_up, []
        for rank, ar in self._ars.items():
            if rank in self._ended:
                continue
            self._pump(rank, out)
            if ar.ready():
                self._end(rank, out)
        return out

    def settle(self, silent: Sequence[int]) -> list[Observation]:
        # A dead engine is noticed by the cluster a moment after the peers that it left in a
        # collective report their knock-on errors: wait briefly for every outcome.
        out: list[Observation] = []
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
            if event.get("kind") == EventKind.STARTED and event.get("pid") is not None:
                self._pids[rank] = event["pid"]
            out.append(WorkerEvent(rank, event))
        for stream in ("stdout", "stderr"):
            text = getattr(ar, stream) or ""
            pos = self._out_pos.get((rank, stream), 0)
            if len(text) > pos:
                self._out_pos[(rank, stream)] = len(text)
                out.append(Output(rank, stream, text[pos:]))

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
            out.append(WorkerEvent(rank, dict(outcome, rank=rank)))
            out.append(Exited(rank, code=1, pid=pid))

    def _lost(self, rank: int, error: Exception) -> list[Observation]:
        """The call raised in the notebook: the engine died, or could not even start the call."""
        ename = getattr(error, "ename", type(error).__name__)
        eid = self.engines.ids[rank]
        pid = self._pids.get(rank)
        if ename == "EngineError":
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

    def _signal(self, sig: int, ranks: Sequence[int]) -> None:
        """Signal the engines of ``ranks`` that run our function. A rank not started yet (its
        engine may still run another task, and has none of our handlers) gets no signal; an
        interrupt takes its call out of the engine's queue instead."""
        ranks = [r for r in ranks if r not in self._ended]
        started = [r for r in ranks if r in self._pids]
        if sig == signal.SIGINT:
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
        self._signal(STACK_SIGNAL, ranks)

    def abandon(self) -> None:
        # Ranks waiting for their peers see the mark even if a signal is lost.
        self.directory.mark_ended()
        self.interrupt([r for r in self._ars if r not in self._ended])

    def close(self) -> None:
        """Nothing to free: the engines are the cluster's."""
