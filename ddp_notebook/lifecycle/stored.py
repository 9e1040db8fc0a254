"""A run as its directory keeps it (``Run.load`` reads it back): the event log, replayed and
checked, the ending of a run whose notebook died, the kept call, the result.

>>> read_run("/nonexistent/run")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ddp_notebook.errors.RunLoadError: there is no run at '/nonexistent/run' (given '/nonexistent/run'): ...
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Optional

from ..core import bounds
from ..core.devices import Device, parse_devices
from ..core.errors import RunLoadError
from ..core.events import EventKind
from ..core.failures import FailureKind, Phase, WorkerFailure
from ..core.rundir import RunDir, default_run_root
from ..core.state import RunStatus
from ..core.stream import EventStream
from ..transfer import pickling
from ..transfer.loading import Received
from .resume import KEEP_LIMIT, KeptCall, read_call

__all__ = ["StoredRun", "read_run", "find_stored_run", "CUT_OFF", "keep_result", "load_result", "output_of"]


@dataclass
class StoredRun:
    """What a run's directory holds, read back."""

    directory: RunDir
    stream: EventStream  # the log replayed (ended, when the notebook died first)
    devices: list[Device]
    call: Optional[KeptCall]  # for a retry (None: not kept)
    result: Optional[bytes]  # the pickled return value of the main worker (None: none)


def find_stored_run(run_id: str, root: Optional[str] = None) -> Optional[str]:
    """The directory of the run ``run_id`` (or the one run whose id ends with it) under ``root``
    (default: the default runs folder), or None: how a run of an earlier kernel is found by id."""
    root = root or default_run_root()
    try:
        names = [n for n in os.listdir(root) if os.path.isfile(os.path.join(root, n, RunDir.EVENTS))]
    except OSError:
        return None
    matches = [n for n in names if n == run_id] or [n for n in names if run_id and n.endswith(run_id)]
    return os.path.join(root, matches[0]) if len(matches) == 1 else None


def read_run(run_dir: Any) -> StoredRun:
    """The run in ``run_dir`` (or with that id under the default runs folder), or ``RunLoadError``
    saying why there is none that can be read there."""
    directory = RunDir(_run_path(run_dir))
    if not os.path.isfile(directory.events_path):
        raise RunLoadError(f"there is no run at {directory.path!r} (given {run_dir!r}): a run directory holds "
                           f"{RunDir.EVENTS}. Give a run's directory, or its id under {default_run_root()!r}")
    try:
        stream = EventStream.replay(_checked_events(directory.iter_events()))
        if not stream.state.finished:
            _end_cut_off(stream)
        devices = parse_devices(stream.state.devices, cuda_count=lambda: 0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        # a log cut short, edited or not ddp_notebook's: every way reading it fails is this one error
        raise RunLoadError(f"the event log {directory.events_path!r} cannot be read as a run's: "
                           f"{type(e).__name__}: {e}") from None
    call = read_call(directory)
    try:
        result = directory.read_result()
    except IsADirectoryError:
        raise RunLoadError(f"{directory.join(RunDir.RESULT)!r} is not a run's result") from None
    return StoredRun(directory, stream, devices, call, result)


CUT_OFF = ("the notebook process that supervised it ended (a kernel restart or crash) before the run did, "
           "and its workers ended with it")


def _end_cut_off(stream: EventStream) -> None:
    """A log that ends without the run's end: its notebook process died, and its workers with it
    (their lifeline). Fold that ending in, in memory, at the time the run was last heard of."""
    t = stream.events[-1].get("time") if stream.events else None
    stream.emit({"kind": EventKind.STOPPING, "time": t, "reason": CUT_OFF})
    for rank, w in sorted(stream.state.workers.items()):
        if not w.finished:
            stream.emit({"kind": EventKind.EXITED, "time": t, "rank": rank, "pid": w.pid, "exit_code": None,
                         "signal": None, "by_supervisor": True})
    stream.emit({"kind": EventKind.RUN_FINISHED, "time": t, "status": RunStatus.STOPPED})


def _run_path(run_dir: Any) -> str:
    """The directory ``Run.load`` reads: ``run_dir`` itself, or a run id under the default runs folder."""
    path = os.fspath(run_dir) if isinstance(run_dir, os.PathLike) else run_dir
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise RunLoadError(f"Run.load takes a run's directory or its id (a str), not {run_dir!r}")
    if os.sep not in path and not os.path.isdir(path):
        return os.path.join(default_run_root(), path)
    return path


def _checked_events(events: Iterable[Any]) -> Iterator[dict[str, Any]]:
    """The events of a log, one at a time (a log may be hundreds of MB), refused unless each is an
    event (an object with a known kind) and the first says the run started."""
    kinds = set(EventKind)
    number = 0
    for number, event in enumerate(events, 1):
        if not isinstance(event, dict) or event.get("kind") not in kinds:
            raise ValueError(f"line {number} is not an event: {str(event)[:100]!r}")
        if number == 1 and event["kind"] != EventKind.RUN_STARTED:
            raise ValueError("it does not start with the run's start")
        yield event
    if number == 0:
        raise ValueError("it holds no event")


def keep_result(directory: RunDir, result: Received, loaded: Optional[tuple[Any]]) -> bool:
    """Keep a run's result (``loaded``: its value, unpickled) in its directory, so the run can be
    reloaded after a restart: by value, and only up to ``KEEP_LIMIT`` when it came with shared
    tensors (a large model's weights are not written to disk a second time). False when it was
    not kept. What this process holds of the result is released; the value keeps its memory."""
    try:
        if result.table is None:
            directory.write_private(RunDir.RESULT, result.data)
        elif len(result.data) + result.shared_bytes <= KEEP_LIMIT and loaded is not None:
            directory.write_private(RunDir.RESULT, pickling.dumps(loaded[0]))
        else:
            return False
        return True
    finally:
        result.release()


def output_of(stream: EventStream, directory: RunDir, run_id: str, rank: int, which: Optional[str]) -> str:
    """Everything ``rank`` printed (``which``: "stdout", "stderr" or None for both): from memory
    while the stream holds all of it, else from the log, saying what the log's limit cut."""
    def wanted(e: dict[str, Any]) -> bool:
        return e["kind"] == EventKind.OUTPUT and e.get("rank") == rank and which in (None, e["stream"])

    if not stream.dropped:  # all of it is still in memory
        return "".join(e["text"] for e in stream.select(wanted))
    parts: list[str] = []
    cut_at = None
    for e in directory.iter_events((EventKind.OUTPUT, EventKind.LOG_TRUNCATED)):
        if e["kind"] == EventKind.LOG_TRUNCATED:
            cut_at = e.get("time")
        elif wanted(e):
            parts.append(e["text"])
    text = "".join(parts)
    if cut_at is None:
        return text
    since = [e for e in stream.select(wanted) if (e.get("time") or 0) >= cut_at]
    note = (f"\n[ddp_notebook: output not kept here: the log of run {run_id} reached its limit of "
            f"{bounds.LOG_BYTES // 2**20} MB; what follows is the most recent output, kept in memory]\n")
    return text + note + "".join(e["text"] for e in since)


def load_result(result: Received, device: str, emit: Callable[[dict[str, Any]], None]) -> Optional[tuple[Any]]:
    """Unpickle the main worker's return value here, once (its tensors mapped from the shared
    memory it came in), as a 1-tuple: a value the notebook cannot load (a class only the workers
    can import) is the run's failure, emitted as one (then None)."""
    try:
        return (result.load(),)
    except Exception as exc:  # noqa: BLE001 - whatever unpickling raises is the report
        failure = WorkerFailure(rank=0, device=device, kind=FailureKind.RESULT, time=time.time(), phase=Phase.RESULT,
                                exc_type=type(exc).__qualname__, message=str(exc))
        emit({"kind": EventKind.FAILURE, "time": failure.time, "rank": 0, "failure": failure.to_dict()})
        return None
