"""``launch``: validate the devices, pack the function, start the workers, return a ``Run``."""
from __future__ import annotations

import linecache
from dataclasses import fields
from typing import Any, Callable, Optional

from .devices import DeviceSpec
from .errors import InvalidDevicesError, NotPicklableError
from .probes import Probe, default_probe
from .run import LaunchOptions, Run
from .validation import ValidationReport, validate_devices

__all__ = ["launch", "launch_with", "validate_for", "default_devices", "set_default_devices", "last_run", "options_from", "first_unpicklable"]

_last_run: Optional[Run] = None
_default_spec: Optional[DeviceSpec] = None


def set_default_devices(spec: Optional[DeviceSpec]) -> None:
    """The device list runs use when none is given (``%ddp_devices SPEC``); None to reset."""
    global _default_spec
    _default_spec = spec


def default_devices(probe: Optional[Probe] = None) -> DeviceSpec:
    """The list set with ``set_default_devices``; else every visible GPU, or two CPU workers."""
    if _default_spec is not None:
        return _default_spec
    probe = probe or default_probe()
    return "cuda" if probe.cuda_count() > 0 else "cpu*2"


def last_run() -> Optional[Run]:
    """The most recently launched run of this process (or None)."""
    return _last_run


def _describe(obj: Any) -> str:
    return type(obj).__module__ + "." + type(obj).__qualname__ if type(obj).__module__ != "builtins" \
        else type(obj).__qualname__


def _captured(fn: Callable) -> list[tuple[str, Any]]:
    """The variables a function closes over or reads as globals: the usual culprits."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    name = getattr(fn, "__name__", "fn")
    out = [(f"{var!r}, used by the function {name!r},", cell.cell_contents)
           for var, cell in zip(code.co_freevars, fn.__closure__ or ()) if _filled(cell)]
    glb = getattr(fn, "__globals__", {})
    out += [(f"the global {var!r}, used by the function {name!r},", glb[var])
            for var in code.co_names if var in glb and not isinstance(glb[var], type(linecache))]
    return out


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents
    except ValueError:
        return False
    return True


def first_unpicklable(parts: list[tuple[str, Any]]) -> Optional[NotPicklableError]:
    """The error for the first of ``(description, object)`` that cannot be pickled, else None."""
    from .pickling import dumps

    for what, obj in parts:
        try:
            dumps(obj)
        except Exception as e:  # noqa: BLE001 - pickling raises many types
            for inner_what, inner in _captured(obj) if callable(obj) else []:
                try:
                    dumps(inner)
                except Exception as inner_e:  # noqa: BLE001
                    return NotPicklableError(inner_what, _describe(inner), str(inner_e) or type(inner_e).__name__)
            return NotPicklableError(what, _describe(obj), str(e) or type(e).__name__)
    return None


def _pack(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """cloudpickle the call, so functions defined in notebook cells travel by value.

    On failure, find the piece that cannot be pickled and say which one it is."""
    from .pickling import dumps

    # Cell sources are only in this process's linecache: ship them so tracebacks raised in the
    # worker show the lines of the cell.
    sources = {name: entry for name, entry in list(linecache.cache.items())
               if len(entry) == 4 and entry[1] is None}
    try:
        return dumps({"fn": fn, "args": args, "kwargs": kwargs, "sources": sources})
    except Exception as whole:  # noqa: BLE001 - pickling raises many types
        parts = [(f"the function {getattr(fn, '__name__', repr(fn))!r}", fn)]
        parts += [(f"argument args[{i}]", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        raise (first_unpicklable(parts) or NotPicklableError("the call", "function call", str(whole))) from None


def validate_for(devices: Optional[DeviceSpec], options: LaunchOptions, probe: Optional[Probe] = None,
                 **shards: Any) -> ValidationReport:
    """The validation report for a launch with these options: on this machine, or on the
    engines of ``options.engines``; ``shards`` (dataset_size, batch_size, drop_last) add the
    empty-shard checks."""
    if options.engines is not None:
        from .engines import validate_on_engines

        return validate_on_engines(devices, options.engines, backend=options.backend,
                                   min_free_memory=options.min_free_memory, **shards)
    return validate_devices(default_devices(probe) if devices is None else devices, backend=options.backend,
                            min_free_memory=options.min_free_memory, probe=probe, **shards)


def _validated(devices: Optional[DeviceSpec], options: LaunchOptions, probe: Optional[Probe]) -> ValidationReport:
    report = validate_for(devices, options, probe)
    if not report.ok:
        raise InvalidDevicesError(report)
    return report


def start_run(payload: bytes, devices: DeviceSpec, options: LaunchOptions, probe: Optional[Probe] = None,
              parent: Optional[Run] = None, report: Optional[ValidationReport] = None) -> Run:
    """Start a run of an already packed call (used by retries too); ``devices`` are validated
    here unless ``report`` says they already were."""
    global _last_run
    report = report or _validated(devices, options, probe)
    cls = Run
    if options.engines is not None:
        from .engine_run import EngineRun

        cls = EngineRun
    cls.check_placement(list(report.devices), options)
    run = cls(payload, report, options, parent=parent)._start()
    _last_run = run
    return run


def launch(
    fn: Callable[..., Any],
    devices: Optional[DeviceSpec] = None,
    args: tuple = (),
    kwargs: Optional[dict] = None,
    *,
    backend: Optional[str] = None,
    min_free_memory: Optional[int] = None,
    stall_timeout: Optional[float] = None,
    timeout: float = 1800.0,
    threads_per_worker: Optional[int] = None,
    stop_grace: float = 10.0,
    kill_grace: float = 3.0,
    progress_interval: float = 0.1,
    run_root: Optional[str] = None,
    env: Optional[dict] = None,
    engines: Any = None,
    probe: Optional[Probe] = None,
) -> Run:
    """Start ``fn(ctx, *args, **kwargs)`` on every device in background workers; return at once.

    Each worker is a fresh process with a torch.distributed process group already set up
    (gloo for CPU, nccl for an all-CUDA list). ``fn`` may be defined in a notebook cell, be a
    closure or a lambda. ``ctx`` is a :class:`~ddp_notebook.context.WorkerContext`.

    The device list is validated first; an invalid one raises ``InvalidDevicesError`` (with
    the report) before any process starts. ``stall_timeout`` (seconds) fails the run, naming
    the stalled rank, when no rank reports progress for that long once one has reported.

    ``engines`` (an ipyparallel Client or DirectView) runs one rank per engine instead of
    local processes; ``devices`` then pairs with the engines (default ``cpu`` on each): see
    :mod:`ddp_notebook.engines`.

    >>> import ddp_notebook
    >>> def train(ctx, steps):
    ...     for step in range(1, steps + 1):
    ...         ctx.log(step=step, total=steps, loss=1.0 / step)
    ...     return ctx.world_size
    >>> ddp_notebook.launch(train, devices="cpu*2", args=(3,)).wait()
    2
    """
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run, not {type(fn).__name__}")
    options = LaunchOptions(
        backend=backend, min_free_memory=min_free_memory, stall_timeout=stall_timeout, timeout=timeout,
        run_root=run_root, threads_per_worker=threads_per_worker, stop_grace=stop_grace,
        kill_grace=kill_grace, progress_interval=progress_interval, env=dict(env or {}), engines=engines,
    )
    return launch_with(fn, devices, tuple(args), dict(kwargs or {}), options, probe)


def launch_with(fn: Callable, devices: Optional[DeviceSpec], args: tuple, kwargs: dict, options: LaunchOptions,
                probe: Optional[Probe] = None, report: Optional[ValidationReport] = None) -> Run:
    """``launch`` with its options already gathered (``fit`` and ``spawn`` use it). The devices
    are validated before the call is packed, unless ``report`` says they already were."""
    report = report or _validated(devices, options, probe)
    payload = _pack(fn, args, kwargs)
    return start_run(payload, report.devices, options, probe=probe, report=report)


def options_from(caller: str, overrides: dict) -> LaunchOptions:
    """LaunchOptions from keyword arguments, refusing unknown names in the caller's words."""
    known = {f.name for f in fields(LaunchOptions)} - {"postprocess", "mode", "resume_from"}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"launch options are {', '.join(sorted(known))}")
    return LaunchOptions(**overrides)
