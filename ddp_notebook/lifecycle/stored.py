"""A run as its directory keeps it (``Run.load`` reads it back): the event log, replayed and
checked, the ending of a run whose notebook died, the kept call, the result; and the runs folder
as a whole: its runs listed (``%ddp_runs --all``) and kept within bounds (``prune_folder``).

A run's directory says which notebook process runs it (``notebook.json``: pid, start time, host,
and what it reads from other runs: ``note_start``). A log without the run's end is a run still
going while that process lives; once it is gone, the run ended with it (a kernel restart or
crash: its workers are tied to it, ``worker.boot.tie_to_parent``), at the step its log last
said, and reads back so (``end_with_notebook``). A notebook that exits on its own (a restart,
a shutdown) writes that ending itself before ending the workers.

>>> read_run("/nonexistent/run")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ddp_notebook.errors.RunLoadError: there is no run at '/nonexistent/run' (given '/nonexistent/run'): ...
"""
from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import psutil

from ..core import bounds
from ..core.devices import Device, parse_devices
from ..core.errors import DDPNotebookError, LaunchOptionError, RunLoadError
from ..core.events import EventKind
from ..core.failures import FailureKind, Phase, WorkerFailure
from ..core.rundir import RunDir, check_private_folder, default_run_root, folder_bytes, is_run_id, runs_limits
from ..core.state import RunState, RunStatus
from ..core.stream import EventStream
from ..transfer import pickling
from ..transfer.loading import Received
from .options import RunSettings
from .resume import KEEP_LIMIT, KeptCall, read_call

__all__ = ["StoredRun", "read_run", "find_stored_run", "keep_result", "load_result", "output_of",
           "note_start", "keep_folder_bounded", "notebook_of", "Notebook", "end_with_notebook",
           "notebook_ended_reason", "stored_runs",
           "read_summary", "replay_state", "prune_folder", "RemovedRun", "delete_run_dir", "kept_by_the_user",
           "launched_from"]

log = logging.getLogger(__name__)


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
    stream = _replayed(directory, directory.iter_events, given=run_dir)
    devices = parse_devices(stream.state.devices, cuda_count=lambda: 0)
    call = read_call(directory)
    try:
        result = directory.read_result()
    except IsADirectoryError:
        raise RunLoadError(f"{directory.join(RunDir.RESULT)!r} is not a run's result") from None
    return StoredRun(directory, stream, devices, call, result)


def read_summary(directory: RunDir) -> RunState:
    """The state of the run in ``directory`` as a list of runs shows it, read quickly: every event
    but progress and output, and the progress of the end of the log (a log may hold hundreds of
    MB); no call, no result. ``RunLoadError`` when it cannot be read as a run's."""
    return _replayed(directory, lambda: _summary_events(directory)).state


def replay_state(directory: RunDir) -> RunState:
    """The state of the run in ``directory`` with all its progress (its series, epochs and
    metrics: what a comparison shows), but what its ranks printed; no call, no result.
    ``RunLoadError`` when it cannot be read as a run's."""
    return _replayed(directory, lambda: _events_without_output(directory)).state


def _events_without_output(directory: RunDir) -> Iterator[dict[str, Any]]:
    with open(directory.events_path, "rb") as f:
        for line in f:
            if not line.endswith(b"\n"):
                return  # being written right now
            if b'"kind": "output"' not in line and line.strip():
                yield json.loads(line)


# The end of a log read for the last progress of each rank (a summary).
_SUMMARY_TAIL = 256 * 2**10


def _summary_events(directory: RunDir) -> Iterator[dict[str, Any]]:
    size = os.path.getsize(directory.events_path)
    position = 0
    with open(directory.events_path, "rb") as f:
        for line in f:
            position += len(line)
            if not line.endswith(b"\n"):
                return  # being written right now
            if b'"kind": "output"' in line or (b'"kind": "progress"' in line and position < size - _SUMMARY_TAIL):
                continue
            if line.strip():
                yield json.loads(line)


def _replayed(directory: RunDir, events: Callable[[], Iterable[dict[str, Any]]], given: Any = None) -> EventStream:
    if not os.path.isfile(directory.events_path):
        raise RunLoadError(f"there is no run at {directory.path!r} (given {given or directory.path!r}): a run "
                           f"directory holds {RunDir.EVENTS}. Give a run's directory, or its id under "
                           f"{default_run_root()!r}")
    try:
        stream = EventStream.replay(_checked_events(events()))
        parse_devices(stream.state.devices, cuda_count=lambda: 0)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        # a log cut short, edited or not ddp_notebook's: every way reading it fails is this one error
        raise RunLoadError(f"the event log {directory.events_path!r} cannot be read as a run's: "
                           f"{type(e).__name__}: {e}") from None
    # A log without the run's end: the run goes on while its notebook process lives (in this
    # process or another: what the log says is true now); it ended with that process.
    if not stream.state.finished and notebook_of(directory) in (Notebook.GONE, Notebook.UNRECORDED):
        end_with_notebook(stream, exited=False)
    return stream


class Notebook:
    """What a run directory's record says of the notebook process that runs it (``notebook_of``)."""

    ALIVE = "alive"
    GONE = "gone"  # ended: a run it did not end ended with it
    UNKNOWN = "unknown"  # on another host, or not ours to look at: it may live
    UNRECORDED = "unrecorded"  # no record (a run of an earlier version, or one starting right now)


def note_start(directory: RunDir, settings: RunSettings) -> None:
    """Record in ``directory`` that this process runs it, and what it reads from other runs (the
    checkpoint it resumes from): what ``notebook_of`` and ``prune_folder`` read."""
    record = {"pid": os.getpid(), "started": psutil.Process().create_time(), "host": platform.node(),
              "reads": [settings.resume_from] if settings.resume_from else []}
    directory.write_private(RunDir.NOTEBOOK, json.dumps(record).encode())


def keep_folder_bounded(directory: RunDir, spare: Iterable[str] = ()) -> None:
    """Keep the runs folder of a run just started within its bounds (``prune_folder``), sparing
    the run, the runs it reads and the directories in ``spare`` (runs this process still holds).
    Called once the run's ranks are on their way (a launch's result never waits for it); a folder
    that cannot be pruned is said in a warning."""
    try:
        prune_folder(os.path.dirname(directory.path), spare=[directory.path, *spare])
    except (DDPNotebookError, OSError) as e:
        warnings.warn(f"ddp_notebook: the runs folder was not pruned: {e}", stacklevel=2)


def _record(directory: RunDir) -> Optional[dict[str, Any]]:
    try:
        data = directory.read_private(RunDir.NOTEBOOK)
        record = json.loads(data) if data is not None else None
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def notebook_of(directory: RunDir) -> str:
    """Whether the notebook process that runs the run in ``directory`` lives (a ``Notebook``
    value): the same pid started at the same time (a pid used again is another process)."""
    record = _record(directory) or {}
    try:
        pid, started, host = int(record["pid"]), float(record["started"]), str(record.get("host", ""))
    except (TypeError, KeyError, ValueError):
        return Notebook.UNRECORDED
    if host and host != platform.node():
        return Notebook.UNKNOWN
    try:
        process = psutil.Process(pid)
        if process.status() == psutil.STATUS_ZOMBIE:
            return Notebook.GONE
        return Notebook.ALIVE if abs(process.create_time() - started) < 1.0 else Notebook.GONE
    except psutil.NoSuchProcess:
        return Notebook.GONE
    except psutil.Error:
        return Notebook.UNKNOWN


def notebook_ended_reason(state: RunState, exited: bool) -> str:
    """Why a run ended with its notebook process, and where it was then; after the stop asked
    before it (``run.stop()``, an interrupt), when its workers had not left yet.

    >>> from ddp_notebook.core.state import WorkerState
    >>> s = RunState(status=RunStatus.RUNNING, workers={0: WorkerState(0, "cpu:0", step=31, total=400)})
    >>> notebook_ended_reason(s, exited=False)
    'the notebook process ended (kernel restart or crash) at step 31 of 400'
    >>> notebook_ended_reason(RunState(workers={0: WorkerState(0, "cpu:0", epoch=4, epochs=40)}), exited=True)
    'the notebook process exited (kernel restart or shutdown) at epoch 5/40'
    >>> s.stop_reason = "stopped by the user"
    >>> notebook_ended_reason(s, exited=True)
    'stopped by the user, then the notebook process exited (kernel restart or shutdown) at step 31 of 400'
    """
    what = "exited (kernel restart or shutdown)" if exited else "ended (kernel restart or crash)"
    stepped = [w for _, w in sorted(state.workers.items()) if w.step is not None]
    if stepped:
        w = stepped[0]  # the main worker's, when it said
        where = f"at step {w.step} of {w.total}" if w.total else f"at step {w.step}"
        where += f" ({w.epoch_text})" if w.epoch is not None else ""
    elif any(w.epoch is not None for w in state.workers.values()):  # epochs, without steps
        w = next(w for _, w in sorted(state.workers.items()) if w.epoch is not None)
        where = f"at {w.epoch_text}"
    elif state.status == RunStatus.STARTING:
        where = "while the workers were starting"
    elif state.origin == "session" and state.request is not None:  # its ranks were in a request
        where = f"in {state.request.what}"
    elif state.origin == "session":  # its ranks run cells, not steps
        where = f"after {state.cells} cell{'' if state.cells == 1 else 's'}"
    else:
        where = "before any step was reported"
    asked = f"{state.stop_reason}, then " if state.stop_reason and not state.notebook_ended else ""
    return f"{asked}the notebook process {what} {where}"


def end_with_notebook(stream: EventStream, exited: bool) -> None:
    """End a run whose notebook process ends (``exited``: this one, leaving now) or ended (its
    log read back): stopped, with the reason (``notebook_ended``), each rank still running ended
    with it, at the time the run was last heard of (or now); a session's request in flight ends
    with it (``ended``, in its cell's record)."""
    state = stream.state
    if state.finished:
        return
    reason = notebook_ended_reason(state, exited)
    last = stream.events[-1].get("time") if stream.events else None
    t = time.time() if exited or last is None else last
    request = state.request
    if request is not None:  # a session's request in flight ended with it: kept, as a cell's end is
        stream.emit({"kind": EventKind.CELL, "time": t, "cell": request.cell, "what": request.what,
                     "ranks": request.ranks, "status": "ended", "code": request.code or request.first_line,
                     "seconds": round(max(t - request.started, 0.0), 3), "message": reason, "failures": [],
                     "values": []})
    stream.emit({"kind": EventKind.STOPPING, "time": t, "reason": reason, "notebook_ended": True})
    for rank, w in sorted(state.workers.items()):
        if not w.finished:
            stream.emit({"kind": EventKind.EXITED, "time": t, "rank": rank, "pid": w.pid, "exit_code": None,
                         "signal": None, "by_supervisor": True})
    stream.emit({"kind": EventKind.RUN_FINISHED, "time": t, "status": RunStatus.STOPPED})


def stored_runs(root: Optional[str] = None) -> list[RunDir]:
    """The run directories under ``root`` (default: the default runs folder), newest first."""
    root = os.path.abspath(root or default_run_root())
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [RunDir(os.path.join(root, n)) for n in names if is_run_id(n)]
    return sorted((d for d in found if os.path.isdir(d.path) and not os.path.islink(d.path)),
                  key=lambda d: (d.id[:15], _start_time(d), _changed_at(d)), reverse=True)


def _changed_at(directory: RunDir) -> int:
    """When the run's directory last had an entry added (ns): the order of runs started in one
    second whose logs say the same start (never the case of real runs' clocks, but of copies)."""
    try:
        return os.stat(directory.path).st_ctime_ns
    except OSError:
        return 0


def _start_time(directory: RunDir) -> float:
    """When the run started, from the first event of its log (0.0: unknown): ids say the second,
    this orders the runs of one second."""
    try:
        with open(directory.events_path, "rb") as f:
            t = json.loads(f.readline()).get("time")
    except (OSError, ValueError, AttributeError):
        return 0.0
    return float(t) if isinstance(t, (int, float)) else 0.0


class RemovedRun(NamedTuple):
    """A run directory ``prune_runs`` removed, and the bytes it held."""

    path: str
    size: int


# A run directory without a record of its notebook, whose log has no end, is taken as ended once
# nothing was written to it for this long (a run of an earlier version; one that starts writes
# its record at once).
_UNRECORDED_QUIET = 600.0


def _has_ended(directory: RunDir) -> bool:
    """Whether the run in ``directory`` is over: its log says so, or its notebook process is gone.
    In doubt, it is not (it is never removed then)."""
    if _log_ends(directory):
        return True
    owner = notebook_of(directory)
    if owner != Notebook.UNRECORDED:
        return owner == Notebook.GONE
    try:
        touched = max(os.stat(p).st_mtime for p in (directory.path, directory.events_path) if os.path.exists(p))
    except (OSError, ValueError):
        return False
    return time.time() - touched > _UNRECORDED_QUIET


def _log_ends(directory: RunDir) -> bool:
    """Whether the run's log holds its end (the last event a run writes, with nothing after it
    but what a closing notebook may add)."""
    try:
        with open(directory.events_path, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 64 * 2**10))
            return b'"kind": "run_finished"' in f.read()
    except OSError:
        return False


def kept_by_the_user(directory: RunDir) -> bool:
    """Whether the user asked to keep the run: it is pinned (``Run.pin``), named or tagged. The
    runs folder's limits never prune it; only ``Run.delete`` removes it."""
    if os.path.exists(directory.join(RunDir.PINNED)):
        return True
    start = directory.first_event() or {}
    return bool(start.get("name") or start.get("tags"))


def launched_from(directory: RunDir) -> Optional[str]:
    """The working directory of the notebook that launched the run (None for a run of an earlier
    version, which did not record it)."""
    cwd = (directory.first_event() or {}).get("cwd")
    return cwd if isinstance(cwd, str) else None


def delete_run_dir(directory: RunDir) -> None:
    """Remove a run's directory (gone already: nothing to do), refusing a run still going in
    another notebook process."""
    if not os.path.lexists(directory.path):
        return
    if not _has_ended(directory):
        raise DDPNotebookError(f"run {directory.id} is still going in another notebook process: stop it there first")
    shutil.rmtree(directory.path, ignore_errors=True)
    if os.path.lexists(directory.path):
        raise DDPNotebookError(f"run {directory.id} could not be removed entirely: {directory.path!r} is still there")


def _checked_limit(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise LaunchOptionError(f"{name} must be a whole number >= 0 or None (the configured limit), not {value!r}")
    return value


def prune_folder(root: Optional[str] = None, keep: Optional[int] = None, max_bytes: Optional[int] = None,
                 spare: Iterable[str] = ()) -> list[RemovedRun]:
    """What :func:`ddp_notebook.prune_runs` does (its parameters, return value and errors), with
    ``spare``: the run directories to keep whatever the limits (``prune_runs`` gives this
    process's runs; each new run's start gives itself and them too).

    Never removed: a run still going (its notebook process lives, in this kernel or another), a
    run a live run reads (the checkpoint it resumes from), a run the user keeps (named, tagged or
    pinned: ``kept_by_the_user``), one in ``spare``, and anything in the folder not named as a run.
    """
    conf_keep, conf_bytes = runs_limits() if keep is None or max_bytes is None else (None, None)
    keep = conf_keep if keep is None else _checked_limit("keep", keep)
    max_bytes = conf_bytes if max_bytes is None else _checked_limit("max_bytes", max_bytes)
    root = os.path.abspath(root or default_run_root())
    if not os.path.isdir(root):
        return []
    check_private_folder(root)
    # Oldest first; the runs the user keeps are outside the limits: neither counted nor removed.
    runs = [d for d in stored_runs(root)[::-1] if not kept_by_the_user(d)]
    live = [d for d in runs if not _has_ended(d)]
    reads = [os.path.realpath(str(path)) for d in live for path in (_record(d) or {}).get("reads") or []]
    kept = {os.path.realpath(p) for p in [*spare, *(d.path for d in live)]}
    kept |= {os.path.realpath(d.path) for d in runs
             if any(path.startswith(os.path.realpath(d.path) + os.sep) for path in reads)}
    sizes = {d.path: folder_bytes(d.path) for d in runs}
    count, total = len(runs), sum(sizes.values())
    removed: list[RemovedRun] = []
    for d in runs:
        if (keep is None or count <= keep) and (max_bytes is None or total <= max_bytes):
            break
        if os.path.realpath(d.path) in kept:
            continue
        shutil.rmtree(d.path, ignore_errors=True)
        if not os.path.lexists(d.path):
            removed.append(RemovedRun(d.path, sizes[d.path]))
            count, total = count - 1, total - sizes[d.path]
    if removed:
        log.info("removed %d runs (%d bytes) from %s", len(removed), sum(r.size for r in removed), root)
    return removed


def _run_path(run_dir: Any) -> str:
    """The directory ``Run.load`` reads: ``run_dir`` itself, or a run id (or its unique end) under
    the default runs folder."""
    path = os.fspath(run_dir) if isinstance(run_dir, os.PathLike) else run_dir
    if not isinstance(path, str) or not path.strip() or "\0" in path:
        raise RunLoadError(f"Run.load takes a run's directory or its id (a str), not {run_dir!r}")
    if os.sep not in path and not os.path.isdir(path):  # an id, or the end of one (as the magics take)
        return find_stored_run(path) or os.path.join(default_run_root(), path)
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
