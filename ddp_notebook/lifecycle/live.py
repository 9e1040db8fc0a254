"""The runs of this process that go on, and what they hold: a second run is refused a GPU or an
engine one of them holds (``validate_on``), an Optuna trial's run waits for its devices
(``trial_turn``), and a notebook that exits ends them tidily.
"""
from __future__ import annotations

import atexit
import contextlib
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import replace
from typing import Any, Optional, Protocol

from ..core.devices import DeviceSpec, parse_devices
from ..core.errors import DDPNotebookError
from ..core.probes import Probe
from ..core.validation import Finding, ValidationReport
from ..executors.base import Executor

__all__ = ["track", "forget", "going", "run_ended", "validate_on", "trial_turn"]

class Run(Protocol):
    """What this module needs of a run (``lifecycle.run.Run``, which registers itself here)."""

    @property
    def id(self) -> str: ...

    @property
    def devices(self) -> Sequence[Any]: ...

    @property
    def done(self) -> bool: ...

    @property
    def status(self) -> str: ...

    @property
    def state(self) -> Any: ...

    def _held(self) -> list[str]: ...

    def _leave_with_notebook(self, deadline: float) -> None: ...


#: Seconds the notebook's exit waits, for every run still going together, for their trackers to
#: take what is left and the run's end (a kernel restart kills a kernel still busy after 5 s).
EXIT_WAIT = 3.0
_live: weakref.WeakSet[Run] = weakref.WeakSet()
# A run that ends notifies this: trials waiting for their devices look again (``trial_turn``).
_runs_ended = threading.Condition(threading.Lock())
# One trial run starts at a time: it waits for its devices, then starts, while the next one waits here.
_trial_starts = threading.Lock()


def track(run: Run) -> None:
    """``run``'s ranks are starting: it holds its devices until it ends."""
    _live.add(run)


def forget(run: Run) -> None:
    """``run`` never started after all (interrupted before anyone watched its ranks)."""
    _live.discard(run)


def going() -> list[Run]:
    """The runs of this process started and not yet ended."""
    return [run for run in list(_live) if not run.done]


def run_ended() -> None:
    """A run ended: a trial waiting for its devices looks again."""
    with _runs_ended:
        _runs_ended.notify_all()


def validate_on(executor: Executor, devices: Optional[DeviceSpec], *, backend: Optional[str] = None,
                min_free_memory: Optional[int] = None, probe: Optional[Probe] = None) -> ValidationReport:
    """The executor's validation of ``devices``, and a ``busy`` error for what another run of this
    process still holds (a GPU, an engine): two runs must not share it by accident."""
    report = executor.validate(devices, backend=backend, min_free_memory=min_free_memory, probe=probe)
    wanted = set(executor.held(report.devices))
    busy = [_held_by(run, item) for run in going() for item in sorted(wanted & set(run._held()))]
    # What another of our runs holds is said once: not also as an engine that does not answer.
    held = {f.device for f in busy}
    kept = tuple(f for f in report.findings if f.device is None or f.device not in held)
    return replace(report, findings=kept + tuple(busy)) if busy else report


def _held_by(run: Run, item: str) -> Finding:
    """``item`` (a GPU, ``engine 1``) is held by ``run``: how to free it, a session's way or a run's."""
    if run.state.origin == "session":
        what, how = "the session of run", "close it (session.close(), %ddp_session --stop)"
    else:
        what, how = "run", "stop it (run.stop(), %ddp_stop)"
    other = "engine" if item.startswith("engine") else "device"
    return Finding("error", "busy", f"{item} is in use by {what} {run.id} ({run.status}): {how} first or choose "
                   f"another {other}.", item)


@contextlib.contextmanager
def trial_turn(devices: Optional[DeviceSpec], trial: Any) -> Iterator[None]:
    """For a run reporting to an Optuna ``trial``: wait until no run of this process that goes on
    uses one of ``devices``, and hold the turn while the run starts (trials that
    ``study.optimize(n_jobs=...)`` runs at once take the devices one after the other, never two on
    one device). Nothing for a run without a trial."""
    if trial is None:
        yield
        return
    try:
        wanted = {str(d) for d in parse_devices(devices if devices is not None else _default_spec())}
    except DDPNotebookError:  # validation says what is wrong with the list
        yield
        return
    with _trial_starts:
        with _runs_ended:
            _runs_ended.wait_for(lambda: not any(wanted & {str(d) for d in run.devices} for run in going()))
        yield


def _default_spec() -> DeviceSpec:
    from ..executors.local.executor import default_devices

    return default_devices()


@atexit.register
def _end_live_runs() -> None:
    # The OS's death signal and the lifeline pipe already end orphans; this only makes a normal
    # exit tidy and quick.
    deadline = time.monotonic() + EXIT_WAIT
    # Side by side: a run whose tracker is slow to finish takes no other run's time.
    leaving = [threading.Thread(target=run._leave_with_notebook, args=(deadline,), daemon=True) for run in going()]
    for thread in leaving:
        thread.start()
    for thread in leaving:
        thread.join(max(0.0, deadline - time.monotonic()) + 1.0)
