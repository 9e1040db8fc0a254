"""A run on ipyparallel engines: the same ``Run`` (state, panel, failures, retry), with one rank
per engine instead of one worker process per device.

Each rank is one ``apply_async`` of :func:`ddp_notebook._engine_worker.run_rank` on its
engine. ``EngineSupervisor`` plays the local supervisor's part from the notebook side:
it turns the engines' data messages and output into events, the calls' outcomes into
``WorkerFailure`` records (the same root-cause rule: a dead engine is the cause rather than
the peer that noticed it), and stops a run with signals sent through ipyparallel
(SIGUSR2 = please stop, SIGINT = interrupt). An engine is the user's process, never ours to
kill: one that does not stop after an interrupt is reported and left running.
"""
from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from collections import deque
from typing import Any, Callable, Optional

from .engines import Engines
from ._worker import mark_ended
from .errors import EngineUnavailableError
from .failures import FailureKind, WorkerFailure
from .run import Run
from .stall import dump_stacks, stall_failures
from .supervisor import _PHASE_KIND, FailureRecorder, SupervisorOptions

__all__ = ["EngineRun", "EngineSupervisor"]

_SETTLE = 2.0  # seconds the first failure waits for the others before naming the cause
_POLL = 0.05


class EngineSupervisor(FailureRecorder):
    """Watches the ranks of a run on engines until every call has ended (``supervise()``)."""

    def __init__(self, engines: Engines, configs: list[dict], payload: bytes, options: SupervisorOptions,
                 emit: Callable[[dict, Optional[bytes]], None]) -> None:
        self.engines = engines
        self.configs = configs
        self.payload = payload
        self.options = options
        self._emit = emit
        self.workers: dict = {}  # no local processes: nothing for an exit handler to kill
        self.reported: dict[int, str] = {}
        self.failures: list[WorkerFailure] = []
        self.root: Optional[WorkerFailure] = None
        self.result_blob: Optional[bytes] = None
        self.stop_reason: Optional[str] = None
        self.ready: set[int] = set()
        self.returned: set[int] = set()
        self.steps: dict[int, Optional[int]] = {}
        self.main_ident: dict[int, int] = {}
        self.pids: dict[int, Optional[int]] = {}
        self._ars: dict[int, Any] = {}
        self._ended: set[int] = set()
        self._out_pos: dict[tuple[int, str], int] = {}
        self._stderr: dict[int, deque] = {r: deque(maxlen=40) for r in range(len(configs))}
        self._wake = threading.Event()
        self._commands: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._stop_deadline: Optional[float] = None
        self._interrupt_deadline: Optional[float] = None
        self._interrupted: set[int] = set()
        self._last_progress: Optional[float] = None
        self._settling: Optional[list[WorkerFailure]] = None

    def start(self) -> None:
        from ._engine_worker import run_rank

        for rank, cfg in enumerate(self.configs):
            ar = self.engines.client[self.engines.ids[rank]].apply_async(run_rank, cfg, self.payload)
            ar.add_done_callback(lambda _f: self._wake.set())
            self._ars[rank] = ar

    def request_stop(self, grace: float, reason: str) -> None:
        with self._lock:
            self._commands.append((grace, reason))
        self._wake.set()

    # ---- main loop -------------------------------------------------------------------
    def supervise(self) -> None:
        try:
            while len(self._ended) < len(self._ars):
                self._wake.wait(_POLL)
                self._wake.clear()
                self._take_commands()
                self._poll()
                self._check_deadlines()
                self._check_stall()
        except BaseException as exc:  # a bug here must still end the run and free the engines
            self._signal(signal.SIGINT, [r for r in self._ars if r not in self._ended])
            self._emit({"kind": "supervisor_error", "time": time.time(), "message": repr(exc)}, None)

    def _poll(self) -> None:
        for rank, ar in self._ars.items():
            if rank in self._ended:
                continue
            self._pump(rank)
            if ar.ready():
                self._end(rank)

    def _pump(self, rank: int) -> None:
        """Events the engine published, and what it printed, since the last look."""
        ar = self._ars[rank]
        data = ar.data
        for key in sorted(data):
            event = data.pop(key)
            self._on_event(rank, dict(event, rank=rank))
        for stream in ("stdout", "stderr"):
            text = getattr(ar, stream) or ""
            pos = self._out_pos.get((rank, stream), 0)
            if len(text) > pos:
                self._out_pos[(rank, stream)] = len(text)
                chunk = text[pos:]
                if stream == "stderr":
                    self._stderr[rank].extend(chunk.splitlines())
                self._emit({"kind": "output", "time": time.time(), "rank": rank, "stream": stream, "text": chunk},
                           None)

    def _on_event(self, rank: int, event: dict) -> None:
        kind = event.get("kind")
        if kind == "started":
            self.main_ident[rank] = event.get("main_thread")
            self.pids[rank] = event.get("pid")
        elif kind == "ready":
            self.ready.add(rank)
        elif kind == "returned":
            self.returned.add(rank)  # waits for its peers now: never the straggler
        elif kind == "progress":
            self._last_progress = time.monotonic()
            if event.get("step") is not None:
                self.steps[rank] = event["step"]
        self._emit(event, None)

    def _end(self, rank: int) -> None:
        """The call of ``rank`` has ended: its outcome becomes events (and maybe a failure)."""
        if rank in self._ended:
            return
        self._ended.add(rank)
        ar = self._ars[rank]
        ar.wait_for_output(1.0)  # the data and output that travelled beside the result
        self._pump(rank)
        try:
            outcome = ar.get(0)
        except Exception as e:  # noqa: BLE001 - ipyparallel's RemoteError / EngineError
            self._engine_lost(rank, e)
            return
        if outcome.get("kind") == "done":
            self.reported[rank] = "done"
            if rank == 0:
                self.result_blob = outcome.get("blob")
            self._emit({"kind": "done", "time": outcome.get("time", time.time()), "rank": rank}, None)
            self._exited(rank, 0, by_us=False)
            return
        self.reported[rank] = "error"
        event = dict(outcome, rank=rank)
        self._emit(event, None)
        # Interrupted by us before it reported: stopped, not failed, as a worker process that its
        # supervisor terminated. After a peer's failure that is whatever it raised on the way out
        # (the collective the failure broke); after a stop, only if the engine saw the interrupt
        # (an error of its own that came first is a failure).
        by_us = rank in self._interrupted and (bool(event.get("interrupted")) or self.root is not None)
        self._exited(rank, 1, by_us=by_us)
        if by_us:
            return
        self._fail(WorkerFailure(
            rank=rank, device=self._label(rank), kind=_PHASE_KIND.get(event.get("phase", "run"), "exception"),
            time=event.get("time", time.time()), pid=self.pids.get(rank), phase=event.get("phase", "run"),
            exc_type=event.get("exc_type"), message=event.get("message", ""), traceback=event.get("traceback", ""),
            last_step=self.steps.get(rank)))

    def _engine_lost(self, rank: int, error: Exception) -> None:
        """The call raised in the notebook: the engine died, or could not even start the call."""
        ename = getattr(error, "ename", type(error).__name__)
        evalue = getattr(error, "evalue", str(error))
        eid = self.engines.ids[rank]
        phase = "run" if rank in self.ready else "startup"
        if ename != "EngineError" and rank in self._interrupted:  # our interrupt or abort ended it
            self._exited(rank, None, by_us=True)
            return
        self._exited(rank, None, by_us=False)
        if ename == "EngineError":
            failure = WorkerFailure(rank=rank, device=self._label(rank), kind=FailureKind.ENGINE,
                                    time=time.time(), pid=self.pids.get(rank), phase=phase,
                                    message=f"engine {eid} died", last_step=self.steps.get(rank))
        else:
            failure = WorkerFailure(rank=rank, device=self._label(rank), kind=FailureKind.INIT, time=time.time(),
                                    pid=self.pids.get(rank), phase="startup", exc_type=ename,
                                    message=f"engine {eid} could not start the call: {evalue}",
                                    traceback=str(getattr(error, "traceback", "") or ""))
        self._fail(failure)

    def _label(self, rank: int) -> str:
        """How failures name the rank's place: ``cpu:1 on engine 3``."""
        return f"{self.configs[rank]['device']} on engine {self.engines.ids[rank]}"

    def _exited(self, rank: int, code: Optional[int], by_us: bool) -> None:
        self._emit({"kind": "exited", "time": time.time(), "rank": rank, "pid": self.pids.get(rank),
                    "exit_code": code, "signal": None, "by_supervisor": by_us}, None)

    # ---- failures and stopping ---------------------------------------------------------
    def _gather(self) -> None:
        # A dead engine is noticed by the cluster a moment after the peers that it left in a
        # collective report their knock-on errors: wait briefly for every outcome.
        deadline = time.monotonic() + _SETTLE
        while time.monotonic() < deadline and len(self._ended) < len(self._ars):
            self._wake.wait(_POLL)
            self._wake.clear()
            self._poll()

    def _stop_peers(self) -> None:
        self._interrupt_alive()

    def _alive(self) -> list[int]:
        return [r for r in self._ars if r not in self._ended]

    def _signal(self, sig: int, ranks: list[int]) -> None:
        """Signal the engines of ``ranks`` that run our function. A rank not started yet (its
        engine may still run another task, and has none of our handlers) gets no signal; an
        interrupt takes its call out of the engine's queue instead."""
        started = [r for r in ranks if r in self.pids]
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

    def abandon(self) -> None:
        """The notebook process is leaving: interrupt every rank still running (and mark the run
        ended, which ranks waiting for their peers see even if a signal is lost)."""
        mark_ended(self.configs[0]["run_dir"])
        alive = self._alive()
        self._interrupted.update(alive)
        self._signal(signal.SIGINT, alive)

    def _interrupt_alive(self) -> None:
        alive = self._alive()
        self._interrupted.update(alive)
        self._signal(signal.SIGINT, alive)
        self._interrupt_deadline = time.monotonic() + self.options.kill_grace

    def _take_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        for grace, reason in commands:
            if self.stop_reason is None and self.root is None and self._alive():
                self.stop_reason = reason
                self._emit({"kind": "stopping", "time": time.time(), "reason": reason}, None)
                self._signal(signal.SIGUSR2, self._alive())
                self._stop_deadline = time.monotonic() + grace

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if self._stop_deadline is not None and now >= self._stop_deadline:
            self._stop_deadline = None
            self._interrupt_alive()
        if self._interrupt_deadline is not None and now >= self._interrupt_deadline:
            self._interrupt_deadline = None
            for rank in self._alive():
                # Not ours to kill: say so, and stop waiting for it.
                self._ended.add(rank)
                self._emit({"kind": "output", "time": time.time(), "rank": rank, "stream": "stderr",
                            "text": f"ddp_notebook: engine {self.engines.ids[rank]} did not stop within "
                                    f"{self.options.kill_grace:.0f} s of an interrupt and still runs the function; "
                                    "interrupt or restart that engine before its next task.\n"}, None)
                self._exited(rank, None, by_us=True)

    def _check_stall(self) -> None:
        timeout = self.options.stall_timeout
        if (not timeout or self._last_progress is None or self.root is not None or self.stop_reason is not None):
            return
        idle = time.monotonic() - self._last_progress
        alive = [r for r in self._alive() if r not in self.reported and r not in self.returned]
        if idle < timeout or not alive:
            return
        stacks = dump_stacks({r: self.configs[r]["stack_file"] for r in alive},
                             lambda: self._signal(signal.SIGUSR1, alive))
        found = stall_failures(stacks, self.main_ident, self.steps, idle,
                               {r: self._label(r) for r in alive}, {r: self.pids.get(r) for r in alive})
        self._record_stall(found, stacks, idle)


class EngineRun(Run):
    """A run whose ranks are ipyparallel engines (``options.engines``)."""

    def _start_workers(self, config: dict, opts: SupervisorOptions) -> EngineSupervisor:
        engines: Engines = self.options.engines
        info = engines.describe()[: len(self.devices)]
        hosts = engines.hosts()[: len(self.devices)]
        env = dict(config["env"])
        env.pop("CUDA_VISIBLE_DEVICES", None)  # an engine's torch is already set up: it would not apply
        if len(set(hosts)) > 1:
            # Ranks on several hosts must reach each other over the network: gloo/nccl pick the
            # host's interface unless options.env names one.
            for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
                if name not in self.options.env:
                    env.pop(name, None)
        configs = []
        for rank, device in enumerate(self.devices):
            local = hosts.count(hosts[rank])
            threads = self.options.threads_per_worker or max(1, int(info[rank].get("cpu_count", 1)) // local)
            configs.append(dict(
                config, rank=rank, device=str(device), local_rank=hosts[:rank].count(hosts[rank]),
                local_world_size=local, threads=threads, env=dict(env, OMP_NUM_THREADS=str(threads)),
                stack_file=os.path.join(self.run_dir, f"stacks-rank{rank}.txt"), engine=engines.ids[rank],
                arrivals=os.path.join(self.run_dir, "arrivals"), returned=os.path.join(self.run_dir, "returned")))
        supervisor = EngineSupervisor(engines.subset(range(len(self.devices))), configs, self._payload, opts,
                                      self._emit)
        supervisor.start()
        return supervisor

    def _places(self) -> list[str]:
        engines: Engines = self.options.engines
        return [f"engine {eid} on {host}" for eid, host in zip(engines.ids, engines.hosts())][: len(self.devices)]

    @classmethod
    def check_placement(cls, devices: list, options: Any) -> None:
        """Refuse the run, before anything is logged or started, when one of its engines is gone."""
        engines: Engines = options.engines
        gone = [eid for eid in engines.ids[: len(devices)] if eid not in engines.client.ids]
        if gone:
            raise EngineUnavailableError(
                f"engine{'s' if len(gone) > 1 else ''} {', '.join(map(str, gone))} "
                f"{'are' if len(gone) > 1 else 'is'} not available any more; the engines now are "
                f"{list(engines.client.ids)}")

    def _after_finish(self) -> None:
        # Engines are the cluster's: the local warm pool is not involved. A rank still queued on
        # a busy engine sees the mark when it finally starts, and leaves at once.
        mark_ended(self.run_dir)
        for folder in ("arrivals", "returned"):
            shutil.rmtree(os.path.join(self.run_dir, folder), ignore_errors=True)

    def _retry_options(self, devices: Any) -> dict:
        """A retry runs on the engines of the ranks whose devices it keeps (a device this run
        did not use goes to the first engine not used yet)."""
        from .devices import parse_devices
        from .engines import EngineProbe

        devices = parse_devices(devices, cuda_count=EngineProbe(self.options.engines.describe()).cuda_count)
        causing = self.state.causing_ranks
        order = [r for r in range(len(self.devices)) if r not in causing] + sorted(causing)
        taken: list[int] = []
        for device in devices:
            rank = next((r for r in order if r not in taken and str(self.devices[r]) == str(device)), None)
            if rank is None:
                rank = next((r for r in order if r not in taken), None)
            if rank is None:
                break  # more devices than engines: validation says so
            taken.append(rank)
        return {"engines": self.options.engines.subset(taken)}

