"""``launch``: validate the devices where the ranks will run, pack the call, start a ``Run``.

The executor follows from the options: local worker processes, or one rank per ipyparallel
engine with ``engines=``. ``start_run`` is the one way a run starts; a retry is a start too.
"""
from __future__ import annotations

import functools
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Optional

from ..core.devices import DeviceSpec
from ..core.errors import DDPNotebookError, LaunchOptionError
from ..core.events import EventKind
from ..core.experiment import call_config, check_monitor, code_fingerprint, function_name
from ..core.probes import Probe
from ..core.rundir import RunDir
from ..core.state import RunStatus
from ..core.stream import EventStream
from ..core.switches import switched_on
from ..core.validation import InvalidDevicesError, ValidationReport
from ..executors.base import Executor
from ..executors.ipyparallel.executor import IpyparallelExecutor
from ..executors.local import forkserver
from ..executors.local.executor import LocalExecutor, default_devices, set_default_devices
from .call import Call, call_parts, check_arguments
from .live import trial_turn, validate_on
from .options import CallMode, LaunchKwargs, LaunchOptions, RunSettings, Unpack, options_from, takes_launch_options
from .reporting import check_trial, trial_config, trial_direction
from .resume import keep_call
from .run import Run, restart_loaded_runs_with
from .stored import RemovedRun, keep_folder_bounded, note_start, prune_folder

__all__ = ["launch", "launch_with", "start_run", "executor_for", "validate_for", "last_run", "runs", "find_run",
           "prune_runs", "start_fork_server", "stop_fork_server",
           "default_devices", "set_default_devices", "wait_showing", "show_while_waiting", "PROGRESS_ENV"]

# How a run the caller blocks on (``fit()``, ``spawn(join=True)``) is shown while it runs: set by
# the front end (``ui.display``): the live panel in a notebook, progress lines in a terminal. It
# returns what to call once the run has ended (or None). ``$DDP_NOTEBOOK_PROGRESS=0`` hides it.
ShowWhileWaiting = Callable[[Run], Optional[Callable[[], None]]]
_show_while_waiting: Optional[ShowWhileWaiting] = None
PROGRESS_ENV = "DDP_NOTEBOOK_PROGRESS"


def show_while_waiting(hook: Optional[ShowWhileWaiting]) -> None:
    """Set how ``wait_showing`` shows a run (the front end calls this once)."""
    global _show_while_waiting
    _show_while_waiting = hook


def wait_showing(run: Run) -> Any:
    """``run.wait()``, with the run's progress shown meanwhile (see ``show_while_waiting``)."""
    shown = switched_on(PROGRESS_ENV)
    finish = _show_while_waiting(run) if shown and _show_while_waiting is not None else None
    try:
        return run.wait()
    finally:
        if finish is not None:
            finish()

# The runs started in this process, oldest first: the last of them is the current run for every
# front end (``last_run()``, ``_ddp_run``, the magics). The last KEEP_RUNS are held here; older
# ones only while something else holds them (the user's variable, a panel): a run holds its
# result, and a sweep returning a model each run would otherwise keep a hundred models alive. A
# run no longer held is still on disk (``Run.load``, and the magics find it there).
KEEP_RUNS = 3
_runs: deque[Run] = deque()
_older: deque[weakref.ref[Run]] = deque(maxlen=100)
# The calls of the last KEEP_DATA_OF runs given tensors or arrays keep them, for a retry; older
# ones let them go, so that data the notebook deleted is freed (a sweep over new data each run
# would otherwise keep 100 runs' worth alive).
KEEP_DATA_OF = 3
_holding: deque[Call] = deque()


def start_fork_server() -> None:
    """Start the fork server now, in the background (it imports torch): the next launch forks its
    workers at once (``%load_ext ddp_notebook`` calls this)."""
    forkserver.start()


def stop_fork_server() -> None:
    """End the fork server once no run uses it (``%unload_ext``); the next launch starts another."""
    forkserver.stop()


def last_run() -> Optional[Run]:
    """The most recently started run of this process, from any entry point (or None)."""
    return _runs[-1] if _runs else None


def runs() -> list[Run]:
    """The runs started in this process that are still held (the last three always; older ones
    while something else holds them), oldest first."""
    older = [r for r in (ref() for ref in _older) if r is not None]
    return older + list(_runs)


def prune_runs(root: Optional[str] = None, keep: Optional[int] = None,
               max_bytes: Optional[int] = None) -> list[RemovedRun]:
    """Remove the oldest finished runs of the runs folder until it holds at most ``keep`` runs and
    ``max_bytes`` bytes (what ``%ddp_runs --clean`` does, and each new run does at its start).

    Never removed: a run still going (its notebook process lives, in this kernel or another), a
    run this kernel still holds (``runs()``: a retry or resume may read it), a run a live run reads
    (the checkpoint it resumes from), and anything in the folder not named as a run.

    Parameters
    ----------
    root : str, optional
        The runs folder (default ``$DDP_NOTEBOOK_RUNS``, else ``~/.cache/ddp_notebook/runs``).
    keep : int, optional
        How many runs to leave (>= 0; default ``$DDP_NOTEBOOK_KEEP_RUNS``, else 50).
    max_bytes : int, optional
        How many bytes to leave (>= 0; default ``$DDP_NOTEBOOK_RUNS_MAX_BYTES``, else 2 GB).

    Returns
    -------
    list of RemovedRun
        Each run removed, oldest first: its directory (``path``) and the bytes it held (``size``).

    Raises
    ------
    LaunchOptionError
        ``keep`` or ``max_bytes`` (or the environment variable read instead) is not a valid limit.
    UnsafeRunDirError
        Another user could write to the runs folder.

    Examples
    --------
    >>> import tempfile, ddp_notebook
    >>> ddp_notebook.prune_runs(tempfile.mkdtemp(), keep=10)
    []
    """
    return prune_folder(root, keep, max_bytes, spare=[r.run_dir for r in runs()])


def find_run(run_id: str) -> Optional[Run]:
    """A run of this process by its id, or by the end of it (``5266c4``) when that is unique."""
    held = runs()
    matches = [r for r in held if r.id == run_id] or [r for r in held if r.id.endswith(run_id)]
    return matches[-1] if len({r.id for r in matches}) == 1 else None


def executor_for(options: LaunchOptions) -> Executor:
    """Where the ranks of a run with these options execute."""
    return LocalExecutor() if options.engines is None else IpyparallelExecutor(options.engines, options.env)


def validate_for(devices: Optional[DeviceSpec], options: LaunchOptions,
                 probe: Optional[Probe] = None) -> ValidationReport:
    """The validation report for a launch with these options, where its ranks would run."""
    return validate_on(executor_for(options), devices, backend=options.backend,
                       min_free_memory=options.min_free_memory, probe=probe)


def _validated(devices: Optional[DeviceSpec], options: LaunchOptions, probe: Optional[Probe]) -> ValidationReport:
    report = validate_for(devices, options, probe)
    if not report.ok:
        raise InvalidDevicesError(report)
    return report


def start_run(call: Call, devices: DeviceSpec, options: LaunchOptions, settings: RunSettings = RunSettings(),
              parent: Optional[Run] = None, probe: Optional[Probe] = None,
              report: Optional[ValidationReport] = None) -> Run:
    """Start a run of ``call``, packed now (a retry sends the call as it is at the retry);
    ``devices`` are validated first unless ``report`` says they already were. Nothing is created
    when validation, packing or placement refuses the run."""
    report = report or _validated(devices, options, probe)
    payload = call.pack()
    executor = executor_for(options)
    executor.check_placement(report.devices)
    directory = RunDir.create(options.run_root)
    keep_call(directory, payload, options, settings)  # so it can be retried after a kernel restart
    note_start(directory, settings)
    run = Run(directory, EventStream(directory.open_log()), report.devices, executor=executor, options=options,
              settings=settings, report=report, parent=parent, restart=functools.partial(_restart, call))
    run._start(payload)
    try:
        keep_folder_bounded(directory, spare=[r.run_dir for r in runs()])  # once its ranks are on their way
        _runs.append(run)
    except BaseException:  # (an interrupt): a run its caller never got is not left going
        run.stop(grace=0.0)
        raise
    while len(_runs) > KEEP_RUNS:
        _older.append(weakref.ref(_runs.popleft()))
    if call.has_data and call not in _holding:
        _holding.append(call)
        release = functools.partial(_release_after_success, call, run.id)
        run.subscribe(release)
        release({"kind": EventKind.RUN_FINISHED, "status": run.status})  # (it may have ended already)
        while len(_holding) > KEEP_DATA_OF:
            _holding.popleft().release(
                f"it no longer holds the tensors and arrays it was given: only the last {KEEP_DATA_OF} runs given "
                "data keep theirs for a retry (so that data deleted in the notebook is freed); launch it again")
    return run


def _release_after_success(call: Call, run_id: str, event: dict[str, Any]) -> None:
    """A run that succeeded lets go of its data: a retry is for a failed or stopped run."""
    if event.get("kind") == EventKind.RUN_FINISHED and event.get("status") == RunStatus.SUCCEEDED:
        call.release(f"run {run_id} succeeded and let go of the tensors and arrays it was given, so that data "
                     "deleted in the notebook is freed (only failed and stopped runs keep theirs for a retry); "
                     "launch it again")


def _restart(call: Call, devices: DeviceSpec, options: LaunchOptions, settings: RunSettings, parent: Run) -> Run:
    if call.released is not None:
        raise DDPNotebookError(f"run {parent.id} cannot be retried: {call.released}")
    return start_run(call, devices, options, settings, parent=parent)


restart_loaded_runs_with(lambda payload: functools.partial(_restart, Call.saved(payload)))


def launch_with(fn: Callable[..., Any], devices: Optional[DeviceSpec], args: tuple[Any, ...], kwargs: dict[str, Any],
                options: LaunchOptions, settings: RunSettings = RunSettings(), probe: Optional[Probe] = None,
                report: Optional[ValidationReport] = None) -> Run:
    """``launch`` with its options already gathered (``fit`` and ``spawn`` use it). The devices
    are validated before the call is packed, unless ``report`` says they already were."""
    check_arguments(fn, "rank" if settings.mode == CallMode.SPAWN else "ctx", args, kwargs)
    return start_run(Call(fn, args, kwargs), devices, options, settings, probe=probe, report=report)


@takes_launch_options
def launch(fn: Callable[..., Any], devices: Optional[DeviceSpec] = None, args: tuple[Any, ...] = (),
           kwargs: Optional[dict[str, Any]] = None, *, monitor: Optional[str] = None, mode: Optional[str] = None,
           trial: Any = None, probe: Optional[Probe] = None, **options: Unpack[LaunchKwargs]) -> Run:
    """Start ``fn(ctx, *args, **kwargs)`` on every device in background workers; return at once.

    Each worker is a fresh process with a torch.distributed process group already set up
    (gloo for CPU, nccl for an all-CUDA list). ``fn`` may be defined in a notebook cell, be a
    closure or a lambda. Tensors and numpy arrays of 64 kB or more in ``args``/``kwargs`` are
    copied once into shared memory that every rank maps copy-on-write (no copy for data from
    :func:`ddp_notebook.share`, a run's result, or a memory-mapped file); the rest travels with
    cloudpickle. The hang watchdog is on (``stall_timeout="auto"``): a rank frozen while its
    peers wait for it in a collective fails the run, named.

    Parameters
    ----------
    fn : callable
        Called as ``fn(ctx, *args, **kwargs)`` on every rank, ``ctx`` a
        :class:`~ddp_notebook.WorkerContext`. The main worker's (rank 0's) return value is the
        run's result.
    devices : str or list, optional
        The device list, one rank per device (``"cpu*2"``, ``"cuda:0-3"``, a list of strings,
        ``torch.device`` or :class:`~ddp_notebook.Device`); default
        :func:`ddp_notebook.default_devices`. With ``engines``, rank *r* runs on the *r*-th
        engine with the *r*-th device (default ``cpu`` on each).
    args : tuple, default ()
        Positional arguments after ``ctx``.
    kwargs : dict, optional
        Keyword arguments of ``fn``.
    monitor : str, optional
        A value ``fn`` logs with ``ctx.log`` (``"valid_loss"``) whose best the run records
        (``run.metrics["valid_loss.min"]``) and reports to ``trial``.
    mode : {"min", "max"}, optional
        Whether a lower or a higher ``monitor`` is better (default: the trial's study's
        direction, else ``"min"``).
    trial : optuna.trial.Trial, optional
        Report ``monitor`` to this trial each time rank 0 logs it (at its epoch when logged with
        one, else its step); when the trial's pruner says so, the run stops and ``wait()`` raises
        ``optuna.TrialPruned``. The trial's parameters go in the run's config; trials that
        ``study.optimize(n_jobs=...)`` runs at once wait for their devices, one run per device.
    probe : Probe, optional
        Answers validation's questions about this machine (tests pass a ``StaticProbe``).
    **options
        The launch options below.

    Returns
    -------
    Run
        The run, already started; ``run.wait()`` blocks for the main worker's return value.

    Raises
    ------
    InvalidDevicesError
        The device list failed validation (``.report`` says why); no process was started.
    LaunchOptionError
        A launch option cannot work (``timeout=0``, ``env={"X": 1}``, ``tags`` that are not short
        scalars, ``report_to`` naming no tracker, ``trial`` that is no Optuna trial or without
        ``monitor``...).
    ArgumentsError
        ``fn`` cannot be called with ``ctx`` and the arguments given.
    NotPicklableError
        ``fn`` or an argument cannot be sent to the workers (the message names which).
    SharedDataError
        Data mapped from a file that was cut short since it was mapped.

    Examples
    --------
    >>> import ddp_notebook
    >>> def train(ctx, steps):
    ...     for step in range(1, steps + 1):
    ...         ctx.log(step=step, total=steps, loss=1.0 / step)
    ...     return ctx.world_size
    >>> ddp_notebook.launch(train, devices="cpu*2", args=(3,)).wait()
    2
    """
    args, kwargs = call_parts("launch", fn, args, kwargs)
    gathered = options_from("launch", dict(options))
    check_monitor(monitor, mode, "launch")
    check_trial(trial, "launch")
    if trial is not None and monitor is None:
        raise LaunchOptionError("launch(trial=...) needs monitor=, the name of the value your function logs with "
                                "ctx.log that the trial is told (such as monitor='valid_loss')")
    direction = trial_direction(trial)
    if mode is not None and direction is not None and mode != direction:
        raise LaunchOptionError(f"launch()'s mode is {mode!r} but the trial's study is to {direction}imize "
                                f"{monitor!r}: leave mode out (the study's direction is taken) or give "
                                f"mode={direction!r}")
    config = {"function": function_name(fn), **call_config(fn, "ctx", args, kwargs), **trial_config(trial)}
    settings = RunSettings(origin="launch", config=config,
                           code=code_fingerprint([fn]), monitor=monitor,
                           monitor_mode=mode or direction or "min", trial=trial)
    with trial_turn(devices, trial):
        return launch_with(fn, devices, args, kwargs, gathered, settings, probe=probe)
