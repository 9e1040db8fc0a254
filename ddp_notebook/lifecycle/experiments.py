"""Runs as a series of experiments: which runs a list or a comparison holds, found the same way
everywhere.

A run is given as a ``Run``, its id, or a unique end of its id (``5266c4``); a comparison or a
list without runs holds the runs launched from the notebook's working directory (every run of
the runs folder with ``everywhere``), newest last. This process's runs are used as they are now
(a live run updates); the others are read from their logs, without their call or result.

>>> import tempfile
>>> find_runs(["nope"], root=tempfile.mkdtemp())  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
ddp_notebook.errors.RunLoadError: no run 'nope' in this kernel nor in '...': ...
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

from ..core.errors import ArgumentsError, RunLoadError
from ..core.rundir import RunDir, default_run_root
from ..core.state import RunState
from .launch import runs
from .run import Run
from .stored import launched_from, replay_state, stored_runs

__all__ = ["ListedRun", "find_runs", "runs_of_here", "LISTED_ORIGINS"]

# What a comparison holds unless told: runs that trained (a session's cells and a fit's preflight
# step are runs too, listed by %ddp_runs, but there is nothing of them to compare).
LISTED_ORIGINS = ("launch", "fit", "spawn")


@dataclass
class ListedRun:
    """A run in a list or a comparison: this process's ``Run`` (its state as it is now), or the
    state read from its log."""

    id: str
    path: str
    run: Optional[Run] = None
    _state: Optional[RunState] = None

    @property
    def state(self) -> RunState:
        """The run's state: this kernel's run as it is now, or the one its log holds (read once)."""
        if self.run is not None:
            return self.run.state
        if self._state is None:
            self._state = replay_state(RunDir(self.path))
        return self._state

    @property
    def live(self) -> bool:
        """Whether the run goes on in this process (its state still changes; its end already
        folded counts as ended)."""
        return self.run is not None and not self.run.state.finished


def _held() -> dict[str, Run]:
    return {r.id: r for r in runs()}


def _listed(directory: RunDir, held: dict[str, Run]) -> ListedRun:
    return ListedRun(directory.id, directory.path, held.get(directory.id))


def find_runs(refs: Sequence[Any], root: Optional[str] = None) -> list[ListedRun]:
    """The runs ``refs`` names, in that order: each a ``Run``, a run id, or a unique end of one (in
    this process's runs, then in the runs folder). ``RunLoadError`` for an id no run has, or an end
    that several runs' ids share (naming them)."""
    root = os.path.abspath(root or default_run_root())
    held = _held()
    on_disk: Optional[list[RunDir]] = None
    found: list[ListedRun] = []
    for ref in refs:
        if isinstance(ref, Run):
            found.append(ListedRun(ref.id, ref.run_dir, ref))
            continue
        if not isinstance(ref, str) or not ref.strip() or os.sep in ref:
            raise ArgumentsError(f"a run is given as a Run, its id or the end of its id (such as '5266c4'), "
                                 f"not {ref!r}")
        ref = ref.strip()
        if on_disk is None:
            on_disk = stored_runs(root)
        ids = {d.id: d.path for d in on_disk}
        ids.update({r.id: r.run_dir for r in held.values()})
        matches = [i for i in ids if i == ref] or sorted(i for i in ids if i.endswith(ref))
        if not matches:
            raise RunLoadError(f"no run {ref!r} in this kernel nor in {root!r}: %ddp_runs --all lists the runs "
                               "(give a run's id or the end of one)")
        if len(matches) > 1:
            shown = ", ".join(matches[:5]) + (f" and {len(matches) - 5} more" if len(matches) > 5 else "")
            raise RunLoadError(f"{ref!r} ends {len(matches)} run ids ({shown}): give more of the id")
        found.append(ListedRun(matches[0], ids[matches[0]], held.get(matches[0])))
    return found


def runs_of_here(everywhere: bool = False, root: Optional[str] = None,
                 origins: Optional[Sequence[str]] = None) -> list[ListedRun]:
    """The runs of the runs folder launched from this notebook's working directory (every one with
    ``everywhere``), this process's and earlier ones' (a run kept elsewhere, ``run_root=``, is
    given by name instead; another user's is never listed), oldest first; only those ``origins``
    started (``launch``, ``fit``, ``spawn``, ``session``, ``preflight``) when given."""
    root = os.path.abspath(root or default_run_root())
    held = _held()
    here = os.getcwd()
    listed: dict[str, ListedRun] = {}
    for directory in reversed(stored_runs(root)):  # oldest first
        if _mine(directory) and (everywhere or launched_from(directory) == here):
            listed[directory.id] = _listed(directory, held)
    out = sorted(listed.values(), key=lambda r: (_started_at(r), r.id))
    if origins is not None:
        out = [r for r in out if _origin(r) in origins]
    return out


def _mine(directory: RunDir) -> bool:
    """Whether the run's directory is this user's (a runs folder others may write to, with a sticky
    bit, may hold theirs: never listed as this user's runs)."""
    try:
        owner = os.stat(directory.path).st_uid
    except OSError:
        return False
    return not hasattr(os, "getuid") or owner in (os.getuid(), 0)


def _started_at(listed: ListedRun) -> float:
    if listed.run is not None:
        return listed.run.state.started_at or 0.0
    start = RunDir(listed.path).first_event() or {}
    t = start.get("time")
    return float(t) if isinstance(t, (int, float)) else 0.0


def _origin(listed: ListedRun) -> str:
    if listed.run is not None:
        return listed.run.state.origin
    return str((RunDir(listed.path).first_event() or {}).get("origin") or "launch")
