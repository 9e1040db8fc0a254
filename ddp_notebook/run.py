"""``Run``: a launched DDP run — its workers, events, state, result, and the way to stop or retry it.

Example::

    run = ddp_notebook.launch(train, devices="cpu*2", args=(100,))
    run.status          # 'running'
    run.workers[1].step # how far rank 1 got
    state_dict = run.wait()   # the main worker's return value, or WorkerFailedError
    single = run.retry()      # the same call on one device
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional

from .devices import Device, format_devices
from .errors import DDPNotebookError, NoCheckpointError, NoResultError, RunStoppedError, WaitTimeoutError, WorkerFailedError
from .failures import WorkerFailure
from .pool import get_pool
from .probes import cpu_count
from .processes import WorkerProcess, start_worker
from .state import RunState, RunStatus, WorkerState
from .supervisor import Supervisor, SupervisorOptions
from .validation import ValidationReport

__all__ = ["Run", "LaunchOptions", "WorkerTraceback"]

_live_runs: "weakref.WeakSet[Run]" = weakref.WeakSet()


class WorkerTraceback(Exception):
    """Carries a worker's formatted traceback as the ``__cause__`` of a WorkerFailedError,
    so plain Python shows the worker's stack above the notebook's."""

    def __init__(self, text: str) -> None:
        super().__init__(text)

    def __str__(self) -> str:
        return "\n" + self.args[0]


@dataclass(frozen=True)
class LaunchOptions:
    """Everything about a launch except the function and the devices (kept for retries)."""

    backend: Optional[str] = None
    min_free_memory: Optional[int] = None
    stall_timeout: Optional[float] = None
    timeout: float = 1800.0  # process-group collectives, as torch's default for gloo
    run_root: Optional[str] = None
    threads_per_worker: Optional[int] = None
    stop_grace: float = 10.0
    kill_grace: float = 3.0
    progress_interval: float = 0.1
    env: dict = field(default_factory=dict)
    resume_from: Optional[str] = None  # a checkpoint directory the function may resume from
    mode: str = "context"  # "context": fn(ctx, ...); "spawn": fn(rank, ...) sets up its own group
    # Turns the main worker's return value into what wait() gives back (fit's FitResult);
    # stays in the notebook, never sent to the workers.
    postprocess: Optional[Callable[[Any, "Run"], Any]] = field(default=None, compare=False)
    # ipyparallel engines to run on (a Client, a DirectView or Engines), one rank per engine.
    engines: Any = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.engines is not None:
            from .engines import engines_of

            object.__setattr__(self, "engines", engines_of(self.engines))


def default_run_root() -> str:
    """``$DDP_NOTEBOOK_RUNS``, else ``~/.cache/ddp_notebook/runs``."""
    if os.environ.get("DDP_NOTEBOOK_RUNS"):
        return os.environ["DDP_NOTEBOOK_RUNS"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ddp_notebook", "runs")


class Run:
    """A DDP run in background worker processes (one per device; rank 0 is the main worker).

    Created by :func:`ddp_notebook.launch`; everything here is safe to call from any thread.
    """

    def __init__(self, payload: bytes, report: ValidationReport, options: LaunchOptions,
                 parent: Optional["Run"] = None) -> None:
        self.devices: list[Device] = list(report.devices)
        self.backend: str = report.backend or "gloo"
        self.report = report
        self.options = options
        self.parent = parent
        self.id = time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex()
        root = options.run_root or default_run_root()
        self.run_dir = os.path.join(os.path.abspath(root), self.id)
        os.makedirs(self.run_dir, mode=0o700, exist_ok=False)
        self.state = RunState()
        self.events: list[dict] = []
        self._payload = payload
        self._lock = threading.RLock()
        self._finished = threading.Event()
        self._subscribers: list[Callable[[dict], None]] = []
        self._log = open(os.path.join(self.run_dir, "events.jsonl"), "a", buffering=1)
        self._supervisor: Optional[Supervisor] = None
        self._result_blob: Optional[bytes] = None

    @classmethod
    def load(cls, run_dir: str) -> "Run":
        """A finished run read back from its directory (for instance after a kernel restart):
        its state, events, failures and (when it succeeded) its result. It cannot be retried:
        the function and its arguments are not kept on disk.

        Example: ``ddp_notebook.Run.load("~/.cache/ddp_notebook/runs/20261129-174217-5266c4").result()``
        """
        from .devices import parse_devices

        run_dir = os.path.abspath(os.path.expanduser(run_dir))
        run = cls.__new__(cls)
        run.run_dir, run.id = run_dir, os.path.basename(run_dir)
        run.state, run.events = RunState(), []
        with open(os.path.join(run_dir, "events.jsonl")) as f:
            for line in f:
                if line.strip():
                    event = json.loads(line)
                    run.events.append(event)
                    run.state.apply(event)
        run.devices = parse_devices(run.state.devices, cuda_count=lambda: 0)
        run.backend = run.state.backend or "gloo"
        run.report, run.options, run.parent, run._payload = None, LaunchOptions(), None, None
        run._lock, run._finished, run._subscribers = threading.RLock(), threading.Event(), []
        run._log, run._supervisor, run._result_blob = None, None, None
        result = os.path.join(run_dir, "result.pkl")
        if os.path.exists(result):
            with open(result, "rb") as f:
                run._result_blob = f.read()
        run._finished.set()
        return run

    # ---- lifecycle -------------------------------------------------------------------
    def _start(self) -> "Run":
        n = len(self.devices)
        threads = self.options.threads_per_worker or max(1, cpu_count() // n)
        config = {
            "world_size": n, "backend": self.backend, "run_id": self.id, "run_dir": self.run_dir,
            "init_file": os.path.join(self.run_dir, "rendezvous"),
            "timeout": self.options.timeout, "threads": threads, "sys_path": _sys_path(),
            "progress_interval": self.options.progress_interval, "resume_from": self.options.resume_from,
            "mode": self.options.mode,
        }
        # Gloo and NCCL listen on the loopback interface only; CPU runs see no GPU at all.
        env = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": str(threads)}
        if all(d.kind == "cpu" for d in self.devices):
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update({k: str(v) for k, v in self.options.env.items()})
        config["env"], config["cwd"] = env, os.getcwd()
        self._emit({"kind": "run_started", "time": time.time(), "run_id": self.id,
                    "devices": [str(d) for d in self.devices], "backend": self.backend,
                    "run_dir": self.run_dir, "parent": self.parent.id if self.parent else None,
                    "places": self._places()}, None)
        opts = SupervisorOptions(kill_grace=self.options.kill_grace, stop_grace=self.options.stop_grace,
                                 stall_timeout=self.options.stall_timeout)
        self._supervisor = self._start_workers(config, opts)
        _live_runs.add(self)
        threading.Thread(target=self._supervise, name=f"ddp-run-{self.id}", daemon=True).start()
        return self

    def _start_workers(self, config: dict, opts: SupervisorOptions) -> Any:
        """Start one worker process per device (warm ones from the pool when it has them)
        and return the supervisor that watches them."""
        config = dict(config, payload=os.path.join(self.run_dir, "payload.pkl"))
        _write_private(config["payload"], self._payload)
        workers: list[WorkerProcess] = []
        warm = get_pool().take(len(self.devices))
        try:
            for rank, device in enumerate(self.devices):
                workers.append(start_worker(rank, device, config, warm[rank]))
        except BaseException:
            for w in workers:
                w.signal_group(signal.SIGKILL)
                w.reap()
                w.close()
            for process in warm[len(workers):]:  # warm ones not assigned yet
                if process is not None:
                    process.discard()
            raise
        return Supervisor(workers, opts, self._emit)

    @classmethod
    def check_placement(cls, devices: list, options: LaunchOptions) -> None:
        """Raise before anything is created when the run cannot be placed (engines)."""

    def _places(self) -> Optional[list[str]]:
        """Where each rank runs, when that is not a local worker process (None here)."""
        return None

    def _after_finish(self) -> None:
        # Warm the next run's workers now that this run no longer needs the cores.
        get_pool().refill(len(self.devices))

    def _supervise(self) -> None:
        sup = self._supervisor
        assert sup is not None
        try:
            sup.supervise()
        finally:
            try:
                self._finish(sup)
            finally:  # whatever failed above, wait() must not block forever
                self._finished.set()

    def _finish(self, sup: Any) -> None:
        if sup.root is not None:
            status = RunStatus.FAILED
        elif sup.stop_reason is not None:
            status = RunStatus.STOPPED
        elif all(sup.reported.get(r) == "done" for r in range(len(self.devices))):
            status = RunStatus.SUCCEEDED
        else:
            status = RunStatus.FAILED
        self._result_blob = sup.result_blob
        if sup.result_blob is not None:  # kept so the run can be reloaded after a restart
            _write_private(os.path.join(self.run_dir, "result.pkl"), sup.result_blob)
        self._emit({"kind": "run_finished", "time": time.time(), "status": status}, None)
        for name in ("payload.pkl", "rendezvous"):
            try:
                os.unlink(os.path.join(self.run_dir, name))
            except OSError:
                pass
        self._log.close()
        self._after_finish()

    def _emit(self, event: dict, blob: Optional[bytes]) -> None:
        with self._lock:
            self.events.append(event)
            self.state.apply(event)
            if self._log is not None and not self._log.closed:
                self._log.write(json.dumps(event, default=str) + "\n")
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:  # a front end's bug must not stop supervision
                pass

    def subscribe(self, callback: Callable[[dict], None]) -> None:
        """Call ``callback(event)`` for each future event (from the supervisor thread)."""
        with self._lock:
            self._subscribers.append(callback)

    # ---- what users read ----------------------------------------------------------------
    @property
    def status(self) -> str:
        """starting, running, succeeded, failed or stopped."""
        return self.state.status

    @property
    def done(self) -> bool:
        return self._finished.is_set()

    @property
    def workers(self) -> list[WorkerState]:
        """Per-rank state: rank, device, pid, status, step, total, epoch, metrics, output."""
        return [self.state.workers[r] for r in sorted(self.state.workers)]

    @property
    def failures(self) -> list[WorkerFailure]:
        return list(self.state.failures)

    @property
    def root_failure(self) -> Optional[WorkerFailure]:
        return self.state.root_failure

    def output(self, rank: int, stream: Optional[str] = None) -> str:
        """Everything rank ``rank`` printed (``stream`` = "stdout" or "stderr" to choose one)."""
        with self._lock:
            return "".join(e["text"] for e in self.events if e["kind"] == "output" and e["rank"] == rank
                           and (stream is None or e["stream"] == stream))

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the run ends; return the main worker's return value.

        Raises WorkerFailedError when a worker failed, RunStoppedError when the run was stopped
        before the main worker returned, WaitTimeoutError when ``timeout`` passes first
        (the run goes on)."""
        if not self._finished.wait(timeout):
            raise WaitTimeoutError(f"run {self.id} is still {self.status} after {timeout} s")
        return self._outcome()

    def result(self) -> Any:
        """The main worker's return value of a finished run (raises like ``wait``)."""
        if not self._finished.is_set():
            raise NoResultError(f"run {self.id} is still {self.status}; use run.wait() to block until it ends")
        return self._outcome()

    def _outcome(self) -> Any:
        import cloudpickle

        root = self.state.root_failure
        if self.state.status == RunStatus.FAILED and root is not None:
            error = WorkerFailedError(root, self.state.failures, self.run_dir)
            cause = WorkerTraceback(root.traceback or "\n".join(root.stderr_tail) or root.summary())
            raise error from cause
        if self._result_blob is None:
            if self.state.status == RunStatus.STOPPED:
                raise RunStoppedError(f"run {self.id} was stopped ({self.state.stop_reason}) before the main "
                                      "worker returned a result")
            if not self.state.finished:
                raise RunStoppedError(f"the event log of run {self.id} ends while it was {self.status}: the "
                                      "process that supervised it ended before the run did")
            raise WorkerFailedError(*_unexplained(self))
        value = cloudpickle.loads(self._result_blob)
        return self.options.postprocess(value, self) if self.options.postprocess else value

    # ---- control ---------------------------------------------------------------------
    def stop(self, grace: Optional[float] = None, wait: bool = False) -> None:
        """Ask every worker to stop (``ctx.should_stop`` becomes True); workers still running
        after ``grace`` seconds (default ``stop_grace``) are terminated."""
        if self._supervisor is not None and not self.done:
            self._supervisor.request_stop(self.options.stop_grace if grace is None else grace,
                                          "stopped by the user")
        if wait:
            self._finished.wait()

    def retry_without_failed(self, resume: bool = False) -> "Run":
        """Run again on the device list without the devices whose workers caused the failure."""
        causing = self.state.causing_ranks
        keep = [d for rank, d in enumerate(self.devices) if rank not in causing]
        if not keep:
            raise DDPNotebookError(f"every device of run {self.id} failed; choose a device with retry(device=...)")
        return self.retry(devices=keep, resume=resume)

    def retry(self, device: Any = None, resume: bool = False, devices: Any = None, **changes: Any) -> "Run":
        """Run the same function with the same arguments and options again, on one device:
        by default the main device, or the first device that did not fail when it did
        (``devices=[...]`` for a list: a retry is a new start with a smaller device list).

        With ``resume=True`` the new run's ``ctx.load_checkpoint()`` returns this run's last
        checkpoint (the built-in ``fit`` then continues from the epoch after it)."""
        from .launcher import start_run
        from .training import latest_checkpoint

        if self._payload is None:
            raise DDPNotebookError(f"run {self.id} was loaded from disk and cannot be retried: its function and "
                                   "arguments are not kept there; launch it again")
        if devices is None:
            devices = [device if device is not None else self.retry_device()]
        if resume:
            if latest_checkpoint(self.checkpoint_dir) is None:
                raise NoCheckpointError(f"run {self.id} saved no checkpoint to resume from "
                                        f"(looked in {self.checkpoint_dir})")
            changes["resume_from"] = self.checkpoint_dir
        for key, value in self._retry_options(devices).items():
            changes.setdefault(key, value)  # what the caller chose wins
        return start_run(self._payload, devices, replace(self.options, **changes), parent=self)

    def _retry_options(self, devices: Any) -> dict:
        """Option changes a retry on ``devices`` needs (where to run; none for local runs)."""
        return {}

    @property
    def checkpoint_dir(self) -> str:
        """Where ``ctx.save_checkpoint`` (and ``fit``) saved this run's checkpoints."""
        return os.path.join(self.run_dir, "checkpoints")

    def retry_device(self) -> Device:
        """The device ``retry()`` picks: the main one unless it caused the failure."""
        causing = self.state.causing_ranks
        return next((d for rank, d in enumerate(self.devices) if rank not in causing), self.devices[0])

    def __repr__(self) -> str:
        return f"<Run {self.id} {self.status} on {format_devices(self.devices)}>"

    def _ipython_display_(self) -> None:
        # The value of a cell, or display(run): the live panel in a notebook, text elsewhere.
        from .display import show_run

        show_run(self)


def _unexplained(run: Run) -> tuple[WorkerFailure, list[WorkerFailure], str]:
    # Only reachable through a bug in the supervisor: say so rather than guess.
    f = WorkerFailure(rank=0, device=str(run.devices[0]), kind="exception", time=time.time(),
                      exc_type="SupervisorError",
                      message=f"the run ended without a result from the main worker; see {run.run_dir}/events.jsonl")
    return f, [f], run.run_dir


def _write_private(path: str, data: bytes) -> None:
    """Write a file only its owner can read (payloads and results may hold private data)."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
        f.write(data)


def _sys_path() -> list[str]:
    import sys

    return [os.path.abspath(p) if p else os.getcwd() for p in sys.path]


@atexit.register
def _kill_live_runs() -> None:
    # The lifeline pipe already ends orphans; this only makes a normal exit tidy and quick.
    for run in list(_live_runs):
        sup = run._supervisor
        if sup is not None and not run.done:
            sup.abandon()
