"""``Run``: a launched DDP run — a small facade over its directory (``core.rundir``), its event
stream (``core.stream``) and the executor and supervisor that run it.

Example::

    run = ddp_notebook.launch(train, devices="cpu*2", args=(100,))
    run.status          # 'running'
    run.workers[1].step # how far rank 1 got
    state_dict = run.wait()   # the main worker's return value, or WorkerFailedError
    single = run.retry()      # the same call on one device
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, Optional, Union

from ..core.devices import Device, DeviceSpec, format_devices
from ..core.errors import (
    ArgumentsError,
    DDPNotebookError,
    NoCheckpointError,
    NoResultError,
    RunInterrupted,
    RunStoppedError,
    SupervisionError,
    WaitTimeoutError,
    WorkerFailedError,
    WorkerTraceback,
)
from ..core.events import EventKind, RankConfig
from ..core.failures import WorkerFailure
from ..core.rundir import RunDir
from ..core.state import RunState, RunStatus, WorkerState
from ..core.stream import EventStream, Subscriber
from ..core.validation import ValidationReport
from ..executors.base import Executor, StartSpec
from ..executors.local.executor import LocalExecutor
from ..transfer.loading import Received, changed_files
from ..transfer.packing import Packed
from ..transfer.queues import QueueFeeder
from . import live
from .cell_phase import CellPhase
from .options import (
    CallMode,
    LaunchKwargs,
    LaunchOptions,
    RunSettings,
    Unpack,
    check_flag,
    check_option_names,
    check_seconds,
    record_of,
)
from .provenance import GitLookup
from .reporting import Reporter, reporter_of
from .restarts import restart_after
from .resume import KEEP_LIMIT, checkpoint_to_resume
from .sending import send_data
from .store import LoopbackStore
from .stored import delete_run_dir, end_with_notebook, keep_result, load_result, output_of, read_run
from .supervisor import Outcome, Supervisor, SupervisorOptions
from .torch_compat import WorkerProcess, echo_output, process_failure
from .watchdog import AUTO, DEFAULT_FLOOR, auto_floor

__all__ = ["Run", "WorkerTraceback", "Restart", "restart_loaded_runs_with"]

PROVENANCE_WAIT = 3.0  # seconds the end of a run waits for its git lookup (a quick run ends before it)
# How a run starts another with the same call: start_run with the packed call bound (a retry is a
# new start, not a special path).
Restart = Callable[[DeviceSpec, LaunchOptions, RunSettings, "Run"], "Run"]
# How a run read back from disk starts again from its kept call: given by ``lifecycle.launch``,
# which starts runs (and imports this module, so it cannot be imported here).
_restart_of_payload: Optional[Callable[[bytes], Restart]] = None


def restart_loaded_runs_with(restart_of_payload: Callable[[bytes], Restart]) -> None:
    """Set how ``Run.load``'s runs are retried (``lifecycle.launch`` calls this once)."""
    global _restart_of_payload
    _restart_of_payload = restart_of_payload


class Run:
    """A DDP run in background workers (one per device; rank 0 is the main worker).

    Made by :func:`ddp_notebook.launch`, :func:`ddp_notebook.fit` (``wait=False``) and
    :func:`ddp_notebook.spawn` (``join=False``), or read back with :meth:`Run.load`. Everything
    here is safe to call from any thread; the value of a notebook cell, a run shows its panel.

    Examples
    --------
    >>> import ddp_notebook
    >>> run = ddp_notebook.launch(lambda ctx: ctx.rank, devices="cpu*2")
    >>> run.wait(), run.status, [w.device for w in run.workers]
    (0, 'succeeded', ['cpu:0', 'cpu:1'])
    """

    def __init__(self, directory: RunDir, stream: EventStream, devices: Sequence[Device], *,
                 executor: Optional[Executor] = None, options: Optional[LaunchOptions] = None,
                 settings: Optional[RunSettings] = None, report: Optional[ValidationReport] = None,
                 parent: Optional[Run] = None, restart: Optional[Restart] = None) -> None:
        self.dir = directory  #: The run's directory (its paths: ``events_path``, ``checkpoint_dir``...).
        #: The run's id, such as ``"20261129-174217-5266c4"`` (what the magics and ``Run.load`` take).
        self.id = directory.id
        self.run_dir = directory.path  #: The path of the run's directory (its log, call, result, checkpoints).
        self.stream = stream  #: The run's event stream: its state, and the events for ``subscribe``.
        self.devices: list[Device] = list(devices)  #: The devices, one per rank, in rank order.
        self.report = report  #: The validation report of the device list (None for a run read back from disk).
        #: The torch.distributed backend, ``"gloo"`` or ``"nccl"``.
        self.backend: str = (report.backend if report else stream.state.backend) or "gloo"
        self._executor = executor
        #: The launch options the run was started with (a retry starts with them too).
        self.options = options or LaunchOptions()
        self._settings = settings or RunSettings()
        self.parent = parent  #: The run this one retries (None for a first launch).
        #: The run started again after this one failed (``max_restarts``), else None: ``wait`` follows it.
        self.restarted: Optional[Run] = None
        self._restart = restart
        self._finished = threading.Event()
        self._stop_requested = False
        self._supervisor: Optional[Supervisor] = None
        self._result: Optional[Received] = None
        self._loaded: Optional[tuple[Any]] = None  # the result, unpickled once
        self._release_start: Callable[[], None] = lambda: None  # what this start holds until the run ends
        self._from_disk = False  # read back by Run.load: a retry sends the call as it was saved
        self._reporter: Optional[Reporter] = None  # forwards rank 0's values to trackers and a trial
        self._git: Optional[GitLookup] = None  # the working directory's git commit, looked up after the start

    @classmethod
    def load(cls, run_dir: Union[str, os.PathLike[str]]) -> Run:
        """A run read back from its directory, or its id under the default runs folder (for
        instance after a kernel restart): its state, events, failures and (when it succeeded) its
        result.

        It can be retried like the run it was (``retry(resume=True)`` goes on from its last
        checkpoint), from the call kept in its directory: runs started on engines need
        ``engines=`` again, and a call over 64 MB is not kept. A run whose notebook process died
        reads back as stopped, with the reason.

        Parameters
        ----------
        run_dir : str or os.PathLike
            A run's directory, or its id or the unique end of its id (under
            ``$DDP_NOTEBOOK_RUNS``, else ``~/.cache/ddp_notebook/runs``).

        Returns
        -------
        Run
            The run as its directory records it.

        Raises
        ------
        RunLoadError
            No run it can read there.
        UnsafeRunDirError
            The run directory is one that other users can write to.

        Examples
        --------
        ::

            run = ddp_notebook.Run.load("20261129-174217-5266c4")
            run.status, run.failures
            run.retry(resume=True, devices=run.devices)
        """
        stored = read_run(run_dir)
        kept = stored.call
        restart = _restart_of_payload(kept.payload) if kept is not None and _restart_of_payload else None
        run = cls(stored.directory, stored.stream, stored.devices, options=kept.options if kept else None,
                  executor=LocalExecutor() if kept is not None and not kept.on_engines else None,
                  settings=kept.settings if kept else None, restart=restart)
        run._from_disk = True
        run._end(Received(stored.result) if stored.result is not None else None)
        return run

    # ---- lifecycle ------------------------------------------------------------------------------
    def _start(self, payload: Packed) -> Run:
        """Start the ranks of this run (once) on its backend, and the thread that supervises them;
        the call's large tensors and arrays placed for them once (``transfer.packing``)."""
        assert self._executor is not None and self._supervisor is None
        # Read before anything starts (a bad value is refused with nothing running), and only when used.
        floor = auto_floor() if self.options.stall_timeout == AUTO else DEFAULT_FLOOR
        n = len(self.devices)
        config: RankConfig = {"world_size": n, "backend": self.backend, "run_id": self.id, "run_dir": self.run_dir,
                              "timeout": self.options.timeout, "cwd": os.getcwd(),
                              "sys_path": [os.path.abspath(p) if p else os.getcwd() for p in sys.path],
                              "progress_interval": self.options.progress_interval,
                              "resume_from": self._settings.resume_from, "mode": self._settings.mode,
                              "judged": self._settings.trial is not None}
        self.stream.emit({"kind": EventKind.RUN_STARTED, "time": time.time(), "run_id": self.id,
                          "devices": [str(d) for d in self.devices], "backend": self.backend,
                          "run_dir": self.run_dir, "parent": self.parent.id if self.parent else None,
                          "places": self._executor.places(n), "hosts": self._executor.hosts(n),
                          "waiting": self._executor.waiting_note(),
                          **record_of(self.options, self._settings, self.devices)})
        self._reporter = reporter_of(self.stream, self.options.report_to, self._settings, len(self.devices), self._tell,
                                     lambda reason: self._request_stop(self.options.stop_grace, reason, pruned=True))
        if self._settings.echo:  # subscribed before any rank starts: no line is missed
            self.stream.subscribe(echo_output)
        store = LoopbackStore(n, needed=self._settings.mode == CallMode.SPAWN)  # where code making its own group meets
        held = contextlib.ExitStack()  # closed once: each of what it holds released, the last first
        held.callback(store.close)
        self._release_start = held.close
        try:
            data, placement = send_data(payload, self._executor.maps_memory, self.stream.emit)
            if placement is not None:
                held.callback(placement.release)
            transport = self._executor.start(StartSpec(self.dir, self.devices, data, config,
                                                     threads_per_worker=self.options.threads_per_worker,
                                                     env={**self.options.env, **store.env},
                                                     data=placement.table if placement else None))
            store.serve()  # once the ranks are asked for: they meet there later, if at all
        except BaseException:
            self._release_start()
            raise
        thread = threading.Thread(target=self._supervise, name=f"ddp-run-{self.id}", daemon=True)
        try:
            self._supervisor = Supervisor(
                transport, [self._executor.label(r, d) for r, d in enumerate(self.devices)], self.dir.stack_file,
                SupervisorOptions(kill_grace=self.options.kill_grace, stop_grace=self.options.stop_grace,
                                  stall_timeout=self.options.stall_timeout, stall_floor=floor),
                self.stream.emit,  # and beside the run's events: a session's answers, or the call's queues' items
                self._settings.answers or (QueueFeeder(payload.queues, self._tell, lambda: self.done).deliver
                                           if payload.queues else None),
                functools.partial(changed_files, placement.table if placement else None))
            live.track(self)
            # Before the thread that ends the run starts: a run that fails at once ends the lookup too.
            self._git = GitLookup(self.state.cwd or os.getcwd(), self.stream.emit)
            thread.start()
        except BaseException:
            if thread.ident is None:  # interrupted before anyone watches the ranks: end them here
                if self._git is not None:
                    self._git.end(0.0)
                live.forget(self)
                transport.abandon()
                transport.close()
                self._release_start()
                self.stream.emit({"kind": EventKind.RUN_FINISHED, "time": time.time(), "status": RunStatus.STOPPED})
                self.stream.close()
                self._end(None)
            raise
        return self

    def _supervise(self) -> None:
        assert self._supervisor is not None and self._executor is not None
        outcome = Outcome(RunStatus.FAILED, None, "the supervisor did not return")
        try:
            outcome = self._supervisor.supervise()
            # Its end is when its ranks ended: what follows (the result, the trackers) is not its length.
            finished: dict[str, Any] = {"kind": EventKind.RUN_FINISHED, "status": outcome.status, "time": time.time()}
            if outcome.result is not None:
                self._loaded = load_result(outcome.result, str(self.devices[0]), self.stream.emit)
                if self._loaded is None:
                    finished["status"] = RunStatus.FAILED
                    outcome.result.release()  # nothing to load: the worker's memory is not kept
                elif not keep_result(self.dir, outcome.result, self._loaded):
                    finished["result_not_kept"] = len(outcome.result.data) + outcome.result.shared_bytes
            main = self.state.workers.get(0)
            if main is not None and main.metrics:  # its record, read back whole by a list of runs
                finished["metrics"] = dict(main.metrics)
            if self.state.best is not None:
                finished["best"] = self.state.best
            if self._reporter is not None:  # the trackers' last values and the run's status, bounded
                self._reporter.finish(str(finished["status"]), self.state.metrics)
            if self._git is not None:
                self._git.end(PROVENANCE_WAIT)
            self.stream.emit(finished)
            self.dir.remove(RunDir.RENDEZVOUS)
            self.stream.close()
            self._executor.finished(self.dir, len(self.devices))
        finally:  # whatever failed above, wait() must not block forever
            self._release_start()
            self._end(outcome.result)

    def _end(self, result: Optional[Received]) -> None:
        self._result = result
        self.restarted = restart_after(self)  # before wait() returns: it follows a restart
        self._finished.set()
        live.run_ended()

    def _leave_with_notebook(self, deadline: float) -> None:
        """The notebook process exits: the run's end is written and the log closed first (the ranks'
        deaths after are the notebook's leaving, as a crash reads back), the trackers told until
        ``deadline`` (``time.monotonic``'s: the tracker's run ends "killed" with the values the log
        holds, not "running" for ever), then every rank is ended."""
        if self._supervisor is not None and not self.done:
            end_with_notebook(self.stream, exited=True)
            self.stream.close()  # what the ranks send from now on is not the run's: its end is written
            if self._reporter is not None:
                self._reporter.finish(RunStatus.STOPPED, self.state.metrics, deadline - time.monotonic(), last=True)
            self._supervisor.abandon()

    def _tell(self, ranks: Sequence[int], request: dict[str, Any], body: Optional[bytes] = None,
              give_up: Optional[Callable[[], bool]] = None) -> list[int]:
        """A request to ``ranks`` (``Transport.send``; a session's, a queue's answer): the ranks it did not reach."""
        sup = self._supervisor
        return list(ranks) if sup is None or self.done else sup.transport.send(ranks, request, body, give_up)

    def _begin_cell(self, request_id: int, cell: Optional[int], ranks: Sequence[int]) -> Optional[CellPhase]:
        """A session's request, judged as a phase of the run: ``Supervisor.begin_cell`` (None: no ranks)."""
        return self._supervisor.begin_cell(request_id, cell, ranks) if self._supervisor is not None else None

    def _held(self) -> list[str]:
        """What the run's ranks hold alone while it runs (a GPU, an engine; see ``Executor.held``)."""
        return self._executor.held(self.devices) if self._executor is not None else []

    # ---- what users read ------------------------------------------------------------------------
    @property
    def state(self) -> RunState:
        """The run's state as it is now: status, every rank's :class:`~ddp_notebook.core.state.WorkerState`,
        failures, progress (what the panel and the text view render)."""
        return self.stream.state

    @property
    def events(self) -> list[dict[str, Any]]:
        """The run's events in order: every lifecycle event, and the most recent progress and output
        (``run.stream.dropped`` counts the older ones, which are in the log, ``run.dir.events_path``)."""
        return self.stream.events

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(event)`` for each future event (from the supervisor thread).

        Parameters
        ----------
        callback : callable
            Called with each event (a dict with its ``"type"``); it must return quickly.

        Raises
        ------
        ArgumentsError
            ``callback`` is not callable.
        """
        if not callable(callback):
            raise ArgumentsError(f"subscribe() takes a function callback(event), not {callback!r}")
        self.stream.subscribe(callback)

    @property
    def status(self) -> RunStatus:
        """The run's :class:`~ddp_notebook.RunStatus`: starting, running, succeeded, failed or stopped."""
        return self.state.status

    @property
    def done(self) -> bool:
        """True once the run has ended (succeeded, failed or stopped) and its outcome is settled."""
        return self._finished.is_set()

    @property
    def stop_requested(self) -> bool:
        """True once ``stop()`` was called on this run while it ran (it may still be stopping)."""
        return self._stop_requested

    @property
    def workers(self) -> list[WorkerState]:
        """Per-rank state: rank, device, pid, status, step, total, epoch, metrics, output."""
        return [self.state.workers[r] for r in sorted(self.state.workers)]

    @property
    def failures(self) -> list[WorkerFailure]:
        """Every worker's failure, the root cause first, then the rest by time (consequences marked)."""
        return list(self.state.failures)

    @property
    def root_failure(self) -> Optional[WorkerFailure]:
        """The failure that caused the run to fail (None unless it failed)."""
        return self.state.root_failure

    # ---- what the run was, and what it gave ------------------------------------------------------
    @property
    def name(self) -> Optional[str]:
        """The run's name (``name=``, ``%ddp_fit --name``; a retry keeps it), or None."""
        return self.state.name

    @property
    def tags(self) -> dict[str, Any]:
        """The run's tags (``tags=``, ``%ddp_fit --tag K=V``; a retry keeps them)."""
        return dict(self.state.tags)

    @property
    def config(self) -> dict[str, Any]:
        """What the run was called with: the function's arguments by parameter name (``fit``'s own:
        ``epochs``, ``batch_size``...), ``devices``, the launch options set, an Optuna trial's
        parameters (``trial.<name>``). Plain values as they are; data summarized
        (``Tensor[896, 8] float32``, ``Net (12.3k parameters)``), a function by its name, a lambda by
        its text with the values it reads. A session records none (its call holds its secret)."""
        return dict(self.state.config)

    @property
    def metrics(self) -> dict[str, Any]:
        """The last value of every metric rank 0 logged; the best of the monitored value
        (``fit``'s ``monitor``, ``launch``'s ``monitor=``) as ``valid_loss.min`` or ``.max``; each
        rank's peak memory in bytes, ``rank0.peak_rss`` (and ``rank0.peak_cuda`` on a GPU)."""
        return self.state.metrics

    @property
    def history(self) -> list[dict[str, Any]]:
        """Rank 0's epochs, one dict each (the panel's epoch table): ``epoch`` (from 0: the panel's
        "epoch 3/8" is ``epoch`` 2), ``train_loss``, every number logged in the epoch, ``seconds``."""
        return self.state.history

    @property
    def provenance(self) -> dict[str, Any]:
        """What reproduces the run beyond its config: ``code`` (a fingerprint of the function's
        source), ``python``, ``ddp_notebook`` and ``torch`` versions, ``git_commit`` and
        ``git_dirty`` of the working directory (``cwd``) when it is in a git work tree."""
        state = self.state
        return {"code": state.code, **state.versions, "cwd": state.cwd}

    @property
    def pinned(self) -> bool:
        """Whether the run is pinned (``pin()``): the runs folder's limits never prune it."""
        return os.path.exists(self.dir.join(RunDir.PINNED))

    def pin(self) -> None:
        """Keep the run whatever the runs folder's limits (as named or tagged): only ``delete()`` removes it."""
        if not self.pinned:
            self.dir.write_private(RunDir.PINNED, b"")

    def unpin(self) -> None:
        """Let the runs folder's limits prune the run again (unless it is named or tagged)."""
        self.dir.remove(RunDir.PINNED)

    def delete(self) -> None:
        """Remove the run's directory (log, result, call, checkpoints): how a named, tagged or pinned
        run goes; the run object keeps what it holds in memory.

        Raises
        ------
        DDPNotebookError
            The run goes on (stop it first).
        """
        if not self.state.finished:
            raise DDPNotebookError(f"run {self.id} is still {self.status}: stop it first (run.stop(), %ddp_stop)")
        delete_run_dir(self.dir)

    def output(self, rank: int, stream: Optional[str] = None) -> str:
        """Everything rank ``rank`` printed.

        Memory keeps the most recent output only; the rest is read from the run's log. Past the
        log's limit (``core.bounds.LOG_BYTES``) the text says what was not kept.

        Parameters
        ----------
        rank : int
            The worker's rank.
        stream : {"stdout", "stderr"}, optional
            One of the two streams (default: both, in the order printed).

        Returns
        -------
        str
            The text printed.

        Raises
        ------
        ArgumentsError
            ``rank`` is not a rank of this run, or ``stream`` is not one of the two.
        """
        if isinstance(rank, bool) or not isinstance(rank, int) or rank not in self.state.workers:
            raise ArgumentsError(f"output() takes the rank of a worker of run {self.id} "
                                 f"({', '.join(map(str, sorted(self.state.workers)))}), not {rank!r}")
        if stream not in (None, "stdout", "stderr"):
            raise ArgumentsError(f"output() takes stream='stdout', 'stderr' or None (both), not {stream!r}")
        return output_of(self.stream, self.dir, self.id, rank, stream)

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the run ends; return the main worker's return value.

        An interrupt (Kernel → Interrupt, Ctrl-C) stops the run: what the wait was for is called
        off, so the workers are not left training unseen.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait at most (None: until the run ends).

        Returns
        -------
        object
            The main worker's return value (for ``fit``, the ``FitResult``).

        Raises
        ------
        WorkerFailedError
            A worker failed; the message names the root cause.
        RunStoppedError
            The run was stopped before the main worker returned.
        WaitTimeoutError
            ``timeout`` passed first (the run goes on).
        RunInterrupted
            An interrupt stopped the run (a ``KeyboardInterrupt``, said in one line).
        NoResultError
            A run read back from disk whose result was not kept.
        SupervisionError
            ddp_notebook's own supervision failed (a bug of the package).

        Examples
        --------
        ::

            run = ddp_notebook.launch(train, devices="cpu*2")
            weights = run.wait()
        """
        check_seconds("timeout", timeout, positive=False, optional=True)
        try:
            ended = self._finished.wait(timeout)
        except KeyboardInterrupt:
            if self.done:
                raise
            raise self._interrupted() from None
        if not ended:
            raise WaitTimeoutError(f"run {self.id} is still {self.status} after {timeout} s")
        return self._value() if self.restarted is None else self.restarted.wait(timeout)

    def result(self) -> Any:
        """The main worker's return value of a finished run, without waiting.

        Returns
        -------
        object
            As :meth:`wait` returns it.

        Raises
        ------
        NoResultError
            The run has not ended yet, or its result was not kept on disk.
        WorkerFailedError
            As :meth:`wait` raises it (and the other exceptions of :meth:`wait`).
        """
        if not self._finished.is_set():
            raise NoResultError(f"run {self.id} is still {self.status}; use run.wait() to block until it ends")
        return self._value()

    def _value(self) -> Any:
        state = self.state
        root = state.root_failure
        if state.status == RunStatus.FAILED and root is not None:
            make = process_failure if self._settings.mode == CallMode.SPAWN else WorkerFailedError  # torch's type too
            error = make(root, state.failures, self.run_dir)
            if self._settings.trial is not None and root.exc_type == "NonFiniteLossError":
                import optuna  # a trial that diverged is pruned, as Optuna's examples do: the study goes on

                raise optuna.TrialPruned(f"run {self.id} diverged: {root.headline()}") from error
            raise error from WorkerTraceback(root.traceback or "\n".join(root.stderr_tail) or root.summary())
        if self._reporter is not None and state.status == RunStatus.SUCCEEDED:
            self._reporter.check_pruned(self.id)  # (pruned as its ranks left: pruned, as in an Optuna loop)
        if state.status == RunStatus.STOPPED and state.pruned:  # (whatever the function returned on its way out)
            import optuna  # the run had a trial: optuna is imported

            raise optuna.TrialPruned(f"run {self.id} was {state.stop_reason}")
        if state.supervisor_error is not None:
            raise SupervisionError(f"the supervision of run {self.id} failed ({state.supervisor_error}); its "
                                   "workers were ended. This is a bug in ddp_notebook: the event log is "
                                   f"{self.dir.events_path}")
        if self._result is None:
            if state.result_not_kept:
                raise NoResultError(f"run {self.id} returned a result of {state.result_not_kept / 2**20:.0f} MB, which "
                                    f"was not kept on disk (results over {KEEP_LIMIT // 2**20} MB with tensors are "
                                    "not); it was only in the notebook process that ran it")
            if state.status == RunStatus.STOPPED:
                raise RunStoppedError(f"run {self.id} was stopped ({state.stop_reason}) before the main "
                                      "worker returned a result")
            raise SupervisionError(f"run {self.id} ended without a result from the main worker; this is a bug in "
                                   f"ddp_notebook: the event log is {self.dir.events_path}")
        value = self._loaded[0] if self._loaded is not None else self._result.load()
        return self._settings.postprocess(value, self) if self._settings.postprocess else value

    # ---- control --------------------------------------------------------------------------------
    def stop(self, grace: Optional[float] = None, wait: bool = False) -> None:
        """Ask every worker to stop; workers still running after ``grace`` seconds are ended.

        ``ctx.should_stop`` becomes True in every worker (loops over ``ctx.epochs`` and
        ``ctx.batches`` leave together); the run ends "stopped". A Lightning or Hugging Face
        ``Trainer`` stops at the same step on every rank.

        Parameters
        ----------
        grace : float, optional
            Seconds the workers get to finish (default the run's ``stop_grace``, 10 s).
        wait : bool, default False
            Block until the run has ended.

        Raises
        ------
        LaunchOptionError
            ``grace`` is not a number of seconds >= 0, or ``wait`` is not True or False.
        DDPNotebookError
            The run was read back (``Run.load``) while another notebook process runs it: only that
            one can stop it.
        """
        if grace is not None:
            check_seconds("grace", grace)  # a nan or negative grace would never end the stop
        check_flag("wait", wait)
        if self._from_disk and not self.state.finished:  # its notebook process lives, and runs it
            here = next((r for r in live.going() if r.id == self.id), None)  # (Run.load in this one: it is here)
            if isinstance(here, Run):
                return here.stop(grace, wait)
            raise DDPNotebookError(f"run {self.id} is {self.state.status} in another notebook process, which alone "
                                   f"can stop it: run.stop() or %ddp_stop {self.id} there")
        self._request_stop(self.options.stop_grace if grace is None else grace, "stopped by the user")
        if wait:
            self._finished.wait()

    def _interrupted(self) -> RunInterrupted:
        """Stop the run the notebook waited for, and wait until it has: a worker sees ``ctx.should_stop``
        (ended after ``stop_grace``); a ``spawn`` function cannot, so its workers end at once (the cell
        run again finds its ports free). A second interrupt meanwhile ends the workers at once."""
        reason = "interrupted in the notebook"
        grace = 0.0 if self._settings.mode == CallMode.SPAWN else self.options.stop_grace
        self._request_stop(grace, reason)
        try:
            self._finished.wait(grace + self.options.kill_grace + 10.0)
        except KeyboardInterrupt:
            self._request_stop(0.0, reason)
            self._finished.wait(self.options.kill_grace + 10.0)
        if self.done:
            return RunInterrupted(f"Run {self.id} {self.status}: {reason}")
        return RunInterrupted(f"Run {self.id} is stopping: {reason} (its workers are being ended)")

    def _request_stop(self, grace: float, reason: str, pruned: bool = False) -> None:
        if self._supervisor is not None and not self.done:
            self._stop_requested = True
            self._supervisor.request_stop(grace, reason, pruned)

    def retry(self, device: Any = None, resume: bool = False, devices: Any = None,
              **changes: Unpack[LaunchKwargs]) -> Run:
        """Run the same function with the same arguments and options again, by default on one device.

        The function and its arguments are sent as they are now, as running the cell again would
        send them: a model or tensor changed in the notebook since the launch is sent changed. A
        run read back with ``Run.load`` sends them as they were saved at its launch (and says so).

        Parameters
        ----------
        device : str or Device, optional
            The one device to run on; default the main device, or the first device that did not
            fail when the main one did.
        resume : bool, default False
            The new run's ``ctx.load_checkpoint()`` returns this run's last checkpoint (the
            built-in ``fit`` then goes on from the epoch after it).
        devices : str or list, optional
            A device list instead of one device (not with ``device``).
        **changes
            Launch options that differ from this run's (``stall_timeout=600``...).

        Returns
        -------
        Run
            The new run, started (its ``parent`` is this run).

        Raises
        ------
        ArgumentsError
            Both ``device`` and ``devices``, or an option that is not a launch option.
        NoCheckpointError
            ``resume=True`` but this run saved no checkpoint.
        DDPNotebookError
            A run read back from disk whose call was not kept (over 64 MB), one that ran on
            engines, retried without ``engines=``, or one still running in another notebook.
        InvalidDevicesError
            The device list of the retry failed validation.

        Examples
        --------
        ::

            run.retry()                          # on the main device, or the first healthy one
            run.retry(device="cpu:1")
            run.retry(resume=True)               # from the last checkpoint
        """
        check_option_names("retry", dict(changes))
        check_flag("resume", resume)
        if device is not None and devices is not None:
            raise ArgumentsError(f"retry() takes device= (one device) or devices= (a list), not both: got "
                                 f"device={device!r} and devices={devices!r}")
        if self._from_disk and not self.state.finished:  # its notebook process lives, and runs it
            raise DDPNotebookError(f"run {self.id} is still {self.state.status} in another notebook process: stop it "
                                   "there (%ddp_stop in that notebook) or let it end, then retry it here")
        if self._restart is None:
            raise DDPNotebookError(f"run {self.id} held a session's ranks: ddp_notebook.session() forms a new session"
                                   if self.state.origin == "session" else
                                   f"run {self.id} was loaded from disk and cannot be retried: its call (the function "
                                   f"and its arguments) was not kept there, as calls over {KEEP_LIMIT // 2**20} MB "
                                   "are not; launch it again (fit(..., resume_from=run) goes on from its checkpoint)")
        if self._executor is None and "engines" not in changes:
            raise DDPNotebookError(f"run {self.id} ran on ipyparallel engines and was loaded from disk: give the "
                                   "engines to retry it on, retry(engines=client)")
        if devices is None:
            devices = [device if device is not None else self._retry_device()]
        settings = self._settings.kept()  # (an Optuna trial is not reported to again)
        if resume:
            if self.dir.latest_checkpoint() is None:
                raise NoCheckpointError(f"run {self.id} saved no checkpoint to resume from "
                                        f"(looked in {self.checkpoint_dir})")
            settings = replace(settings, resume_from=checkpoint_to_resume(self.checkpoint_dir))
        where = self._executor.retry_changes(self.devices, self.state.causing_ranks, devices) if self._executor else {}
        options = replace(self.options, **{**where, **changes})  # what the caller chose wins
        retry = self._restart(devices, options, settings, self)
        if self._from_disk:
            print(f"ddp_notebook: run {self.id} was loaded from disk: retry {retry.id} runs its function with the "
                  "arguments saved when it was launched, not the notebook's objects as they are now", file=sys.stderr)
        return retry

    def retry_without_failed(self, resume: bool = False) -> Run:
        """Run again on the device list without the devices whose workers caused the failure.

        Parameters
        ----------
        resume : bool, default False
            Go on from this run's last checkpoint, as in :meth:`retry`.

        Returns
        -------
        Run
            The new run, started.

        Raises
        ------
        DDPNotebookError
            Every device of the run failed (choose one with ``retry(device=...)``).
        NoCheckpointError
            ``resume=True`` but this run saved no checkpoint.
        """
        check_flag("resume", resume)
        keep = [d for rank, d in enumerate(self.devices) if rank not in self.state.causing_ranks]
        if not keep:
            raise DDPNotebookError(f"every device of run {self.id} failed; choose a device with retry(device=...)")
        return self.retry(devices=keep, resume=resume)

    def _retry_device(self) -> Device:
        """The device ``retry()`` picks: the main one unless it caused the failure."""
        return next((d for r, d in enumerate(self.devices) if r not in self.state.causing_ranks), self.devices[0])

    # ---- what torch.multiprocessing's ProcessContext offers ---------------------------------------
    def join(self, timeout: Optional[float] = None, grace_period: Optional[float] = None) -> bool:
        """As ``ProcessContext.join``: whether the run has ended well, waiting at most ``timeout``
        seconds; a failure raises as ``wait()`` does.

        Parameters
        ----------
        timeout : float, optional
            Seconds to wait (None: until the run ends).
        grace_period : float, optional
            Taken for the same calls, and not needed: ``kill_grace`` says how long a failed
            run's peers get.

        Returns
        -------
        bool
            True once the run has ended well; False while it still runs after ``timeout``.

        Raises
        ------
        WorkerFailedError
            A worker failed (for a ``spawn`` run, also torch's ``ProcessRaisedException`` or
            ``ProcessExitedException``).
        """
        check_seconds("grace_period", grace_period, positive=False, optional=True)
        try:
            self.wait(timeout)
        except WaitTimeoutError:
            return False
        return True

    @property
    def processes(self) -> list[WorkerProcess]:
        """The ranks as ``torch.multiprocessing`` shows its children, in rank order: each a
        :class:`~ddp_notebook.lifecycle.torch_compat.WorkerProcess` (``pid``, ``is_alive()``,
        ``exitcode``, ``join()``), read from the run's state as it is now."""
        return [WorkerProcess(rank, functools.partial(lambda r: self.state.workers[r], rank), self._finished, self.stop)
                for rank in range(len(self.devices))]

    def pids(self) -> list[Optional[int]]:
        """The ranks' process ids, in rank order (None for a rank not started yet): a method, as
        torch's ``ProcessContext.pids()`` is, so code written for it runs unchanged."""
        return [p.pid for p in self.processes]

    @property
    def checkpoint_dir(self) -> str:
        """Where ``ctx.save_checkpoint`` (and ``fit``) saved this run's checkpoints."""
        return self.dir.checkpoint_dir
    # ---- what a front end offers for a relaunch -------------------------------------------------
    def _device_choices(self) -> list[str]:
        """The devices a relaunch of this run can choose from (where its executor runs ranks)."""
        return self._executor.device_choices() if self._executor is not None else []

    def _validate_devices(self, devices: DeviceSpec) -> ValidationReport:
        """Validate ``devices`` for a relaunch where this run ran (this machine, or its engines)."""
        if self._executor is None:
            raise DDPNotebookError(f"run {self.id} was loaded from disk: it has no executor to validate on")
        return live.validate_on(self._executor, devices)

    def __repr__(self) -> str:
        return f"<Run {self.id} {self.status} on {format_devices(self.devices)}>"
