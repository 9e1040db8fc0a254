"""What reproduces a run beyond its call, looked up after its start (never on the launch path):
the git commit of the notebook's working directory, and whether its tracked files had changes.

>>> import tempfile
>>> git_state(tempfile.mkdtemp())
{}
"""
from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any, Optional

from ..core.events import EventKind

__all__ = ["git_state", "GitLookup", "GIT_TIMEOUT"]

GIT_TIMEOUT = 5.0  # seconds each git command may take (a huge work tree): past it, nothing is recorded


def _in_work_tree(path: str) -> bool:
    """Whether ``path`` or a folder above it holds ``.git`` (found without starting git)."""
    current = os.path.abspath(path)
    while True:
        if os.path.exists(os.path.join(current, ".git")):
            return True
        parent = os.path.dirname(current)
        if parent == current:
            return False
        current = parent


def _git(args: list[str], cwd: str, env: dict[str, str],
         started: Callable[[subprocess.Popen[str]], None]) -> tuple[int, str]:
    """Run ``git ARGS`` in ``cwd``: its status and output (``started`` is handed the process)."""
    with subprocess.Popen(["git", *args], cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True) as process:
        started(process)
        try:
            out, _ = process.communicate(timeout=GIT_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            raise
        return process.returncode, out


def git_state(cwd: str, started: Callable[[subprocess.Popen[str]], None] = lambda process: None) -> dict[str, Any]:
    """``{"git_commit": ..., "git_dirty": ...}`` for the work tree ``cwd`` is in (tracked files
    only: an untracked notebook does not make it dirty), ``{}`` when it is in none, git is not
    installed, or git does not answer in ``GIT_TIMEOUT`` s. It takes no lock of the repository
    (``GIT_OPTIONAL_LOCKS=0``): the user's own git commands are never made to wait. ``started``
    is handed each git process as it starts (``GitLookup`` ends the one left when its run ends)."""
    if not _in_work_tree(cwd):
        return {}
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")
    try:
        head_code, head = _git(["rev-parse", "HEAD"], cwd, env, started)
        if head_code != 0:
            return {}
        status_code, status = _git(["status", "--porcelain", "--untracked-files=no"], cwd, env, started)
    except (OSError, subprocess.SubprocessError):
        return {}
    out: dict[str, Any] = {"git_commit": head.strip()}
    if status_code == 0:
        out["git_dirty"] = bool(status.strip())
    return out


class GitLookup:
    """``git_state(cwd)`` on a thread of its own, emitted as the run's ``provenance`` event once
    found, unless the run's end was written first (``end`` waits for it a moment, then ends the
    git command still running: no process of the lookup outlives its run)."""

    def __init__(self, cwd: str, emit: Callable[[dict[str, Any]], None]) -> None:
        self._cwd, self._emit = cwd, emit
        self._lock = threading.Lock()
        self._ended = False
        self._process: Optional[subprocess.Popen[str]] = None  # the git command running now
        self._thread = threading.Thread(target=self._look, name="ddp-provenance", daemon=True)
        self._thread.start()

    def _started(self, process: subprocess.Popen[str]) -> None:
        with self._lock:
            self._process = process
            if self._ended:  # started as the run ended: ended at once
                process.kill()

    def _look(self) -> None:
        found = git_state(self._cwd, self._started)
        with self._lock:
            if found and not self._ended:
                self._emit({"kind": EventKind.PROVENANCE, "time": time.time(), **found})

    def end(self, wait: float) -> None:
        """The run's end is about to be written: wait at most ``wait`` s for the lookup, then end
        the git command still running (its thread collects it); after this, nothing it finds is
        emitted."""
        self._thread.join(wait)
        with self._lock:
            self._ended = True
            process = self._process
        if process is not None and process.poll() is None:
            process.kill()
            self._thread.join(wait)  # collected by its ``communicate``
