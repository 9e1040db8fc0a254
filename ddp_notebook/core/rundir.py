"""A run's directory on disk, and every path inside it, in one place.

::

    <run_root>/<run id>/
        events.jsonl          every event of the run, one JSON object a line
        result.pkl            the main worker's pickled return value (a run that returned one)
        call.pkl              the packed call, options and settings, for a retry after a restart
        rendezvous            the process group's file rendezvous (removed at the end)
        stacks-rank<r>.txt    rank r's stack dumps, for the stall watchdog
        notebook.json         the notebook process that runs it (pid, start time, host) and what it reads
                              from other runs: how a run cut off by its notebook's death is told from a live one
        checkpoints/          ctx.save_checkpoint's files (the last few: ``keep``); ``latest`` names the
                              newest, ``best`` the best one when the saver said which

The notebook side and the worker side both build paths with ``RunDir``.

>>> d = RunDir("/tmp/runs/20261129-174217-5266c4")
>>> d.id, os.path.basename(d.stack_file(1))
('20261129-174217-5266c4', 'stacks-rank1.txt')
"""
from __future__ import annotations

import json
import os
import re
import stat
import time
from collections.abc import Callable, Iterator
from typing import IO, Any, Optional

from .errors import LaunchOptionError, UnsafeRunDirError

__all__ = ["RunDir", "default_run_root", "latest_checkpoint", "check_private_folder", "check_private_file",
           "is_run_id", "runs_limits", "folder_bytes", "KEEP_RUNS", "RUNS_MAX_BYTES", "KEEP_RUNS_ENV",
           "RUNS_MAX_BYTES_ENV"]

KEEP_RUNS_ENV = "DDP_NOTEBOOK_KEEP_RUNS"
RUNS_MAX_BYTES_ENV = "DDP_NOTEBOOK_RUNS_MAX_BYTES"
KEEP_RUNS = 50
"""Runs kept in the runs folder by default (``$DDP_NOTEBOOK_KEEP_RUNS``): older finished ones are removed."""
RUNS_MAX_BYTES = 2 * 10**9
"""Bytes the runs folder holds by default (``$DDP_NOTEBOOK_RUNS_MAX_BYTES``): older finished runs are removed."""

_RUN_ID = re.compile(r"[0-9]{8}-[0-9]{6}-[0-9a-f]{6}")
_CHECKPOINT = re.compile(r"epoch-(-?[0-9]+)\.pt")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "k": 10**3, "m": 10**6, "g": 10**9,
          "t": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

# Files a run's workers or the notebook unpickle (the call, the result, checkpoints) are opened
# without following a link, and created only if absent.
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


def _who(uid: int) -> str:
    try:
        import pwd

        return pwd.getpwuid(uid).pw_name
    except (ImportError, KeyError):
        return f"uid {uid}"


def _unsafe_because(st: os.stat_result, me: int, sticky_protects: bool) -> Optional[str]:
    """Why another user could change what ``st`` describes (None: they cannot): it is theirs, or
    they may write to it (unless ``sticky_protects`` and a sticky bit keeps them off others' files)."""
    if st.st_uid not in (me, 0):
        return f"belongs to {_who(st.st_uid)}"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not (sticky_protects and st.st_mode & stat.S_ISVTX):
        return f"is writable by other users (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_private_folder(path: str, what: str = "the runs folder") -> None:
    """Refuse ``path`` when another user could replace what is inside it: it and every folder
    above it must belong to this user (or to root) and be writable by no one else, unless a
    sticky bit stops others from renaming what is not theirs (``/tmp``).

    A run's files are unpickled by its workers and by ``Run.load``: from a folder that another
    user can write to, they could swap a run directory for theirs and run code as this user."""
    me = os.getuid() if hasattr(os, "getuid") else None
    if me is None:  # no POSIX owners (Windows): nothing to check this way
        return
    current = os.path.abspath(path)
    while True:
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            st = None  # created by the package, owner-only
        if st is not None:
            if stat.S_ISLNK(st.st_mode):
                st = os.stat(current)  # a link: what it points to must be safe
            why = _unsafe_because(st, me, sticky_protects=True)
            if why is not None:
                raise UnsafeRunDirError(
                    f"{what} {path!r} cannot be used: {current!r} {why}, so another user could replace a "
                    "run's files and have your workers load their code. Use a folder only you can write to "
                    f"(for instance {private_run_root()!r}), or make it so: chmod go-w {current!r}")
        parent = os.path.dirname(current)
        if parent == current:
            return
        current = parent


def check_private_file(path: str, what: str) -> str:
    """The real path of ``path`` (links followed), refused unless the file belongs to this user
    (or root) and no one else can write to it, and its real folder passes ``check_private_folder``:
    for a file to be unpickled that the caller named (``fit(resume_from=...)``)."""
    real = os.path.realpath(path)
    check_private_folder(os.path.dirname(real), f"the folder of {what}")
    me = os.getuid() if hasattr(os, "getuid") else None
    why = _unsafe_because(os.stat(real), me, sticky_protects=False) if me is not None else None
    if why is not None:
        raise UnsafeRunDirError(f"{what} {path!r} cannot be used: {real!r} {why}, so another user could have "
                                "written code into it that loading it would run as you")
    return real


def is_run_id(name: str) -> bool:
    """Whether ``name`` is a run directory's name as ``RunDir.create`` makes them (the only folders
    that pruning the runs folder ever removes).

    >>> is_run_id("20261129-174217-5266c4"), is_run_id("my-data")
    (True, False)
    """
    return _RUN_ID.fullmatch(name) is not None


def runs_limits() -> tuple[Optional[int], Optional[int]]:
    """How many runs, and how many bytes, the runs folder keeps: ``$DDP_NOTEBOOK_KEEP_RUNS`` (a
    whole number >= 1, default ``KEEP_RUNS``) and ``$DDP_NOTEBOOK_RUNS_MAX_BYTES`` (bytes, or with a
    unit: ``500MB``, ``2GB``, ``1GiB``; default ``RUNS_MAX_BYTES``); ``off`` for either: no bound.
    A clear ``LaunchOptionError`` for anything else.

    >>> os.environ["DDP_NOTEBOOK_RUNS_MAX_BYTES"] = "1.5 GB"
    >>> runs_limits()
    (50, 1500000000)
    >>> del os.environ["DDP_NOTEBOOK_RUNS_MAX_BYTES"]
    """
    keep = _limit_from_env(KEEP_RUNS_ENV, KEEP_RUNS, "a whole number of runs >= 1",
                           lambda t: int(t) if re.fullmatch(r"[0-9]{1,18}", t) else None)
    size = _limit_from_env(RUNS_MAX_BYTES_ENV, RUNS_MAX_BYTES, "a number of bytes >= 1, with a unit or not (2GB, "
                           "500MB, 1GiB)", _bytes)
    return keep, size


def _bytes(text: str) -> Optional[int]:
    found = re.fullmatch(r"([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([a-z]*)", text.lower())
    if found is None or found.group(2) not in _UNITS:
        return None
    return int(float(found.group(1)) * _UNITS[found.group(2)])


def _limit_from_env(name: str, default: int, valid: str, parse: Callable[[str], Optional[int]]) -> Optional[int]:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if text.lower() in ("off", "none"):
        return None
    value = parse(text) if text.isascii() else None
    if value is None or value < 1:
        raise LaunchOptionError(f"${name} must be {valid}, or off for no bound; not {text!r}")
    return value


def folder_bytes(path: str) -> int:
    """The bytes of the files under ``path`` (links not followed; what vanishes meanwhile is not counted)."""
    total = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(folder, name)).st_size
            except OSError:
                pass
    return total


def default_run_root() -> str:
    """``$DDP_NOTEBOOK_RUNS``, else ``~/.cache/ddp_notebook/runs``."""
    if os.environ.get("DDP_NOTEBOOK_RUNS"):
        return os.environ["DDP_NOTEBOOK_RUNS"]
    return private_run_root()


def private_run_root() -> str:
    """``~/.cache/ddp_notebook/runs`` (``$XDG_CACHE_HOME`` honoured): the runs folder when
    ``$DDP_NOTEBOOK_RUNS`` names none, in the user's own cache."""
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "ddp_notebook", "runs")


def latest_checkpoint(checkpoint_dir: str) -> Optional[str]:
    """The path of the newest checkpoint saved in ``checkpoint_dir`` (None if there is none)."""
    return _named_checkpoint(checkpoint_dir, RunDir.LATEST)


def _named_checkpoint(checkpoint_dir: str, marker: str) -> Optional[str]:
    try:
        with open(os.path.join(checkpoint_dir, marker)) as f:
            path = os.path.join(checkpoint_dir, f.read().strip())
    except OSError:
        return None
    return path if os.path.exists(path) else None


class RunDir:
    """The directory of one run (it need not exist yet: ``create`` makes a new one)."""

    EVENTS = "events.jsonl"
    RESULT = "result.pkl"
    PAYLOAD = "payload.pkl"  # never written: the call travels over each worker's control pipe
    CALL = "call.pkl"  # the call kept for a retry once the notebook is gone (lifecycle.resume); never read by workers
    RENDEZVOUS = "rendezvous"
    CHECKPOINTS = "checkpoints"
    LATEST = "latest"
    BEST = "best"
    NOTEBOOK = "notebook.json"
    PINNED = "pinned"  # present: the run is kept whatever the runs folder's limits (Run.pin)

    def __init__(self, path: str) -> None:
        self.path = os.path.abspath(os.path.expanduser(path))
        self.id = os.path.basename(self.path)

    @classmethod
    def create(cls, root: Optional[str] = None) -> RunDir:
        """A new, empty run directory under ``root`` (default ``default_run_root()``), owner-only."""
        run_id = time.strftime("%Y%m%d-%H%M%S-") + os.urandom(3).hex()
        root = os.path.abspath(root or default_run_root())
        check_private_folder(root)
        os.makedirs(root, mode=0o700, exist_ok=True)
        directory = cls(os.path.join(root, run_id))
        os.mkdir(directory.path, mode=0o700)  # a new name: fails if anything is there already
        return directory

    def __repr__(self) -> str:
        return f"RunDir({self.path!r})"

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    # ---- paths -----------------------------------------------------------------------------
    @property
    def events_path(self) -> str:
        return self.join(self.EVENTS)

    @property
    def rendezvous_path(self) -> str:
        return self.join(self.RENDEZVOUS)

    @property
    def checkpoint_dir(self) -> str:
        return self.join(self.CHECKPOINTS)

    def stack_file(self, rank: int) -> str:
        return self.join(f"stacks-rank{rank}.txt")

    def checkpoint_path(self, epoch: int) -> str:
        return os.path.join(self.checkpoint_dir, f"epoch-{epoch:04d}.pt")

    # ---- reading and writing ------------------------------------------------------------------
    def open_log(self) -> IO[str]:
        """The event log, open for appending one line at a time (owner-only, never through a link)."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        return open(os.open(self.events_path, flags, 0o600), "a", buffering=1)

    def iter_events(self, kinds: Optional[tuple[str, ...]] = None) -> Iterator[dict[str, Any]]:
        """The events of the log one at a time (a log may hold hundreds of MB), only those of
        ``kinds`` when given (other lines are not even parsed)."""
        marks = tuple(f'"kind": "{kind}"' for kind in kinds) if kinds else ()
        with open(self.events_path) as f:
            for line in f:
                if not line.endswith("\n"):
                    return  # being written right now (the log of a running run)
                if line.strip() and (not marks or any(mark in line for mark in marks)):
                    event = json.loads(line)
                    if not kinds or (isinstance(event, dict) and event.get("kind") in kinds):
                        yield event

    def write_private(self, name: str, data: bytes) -> None:
        """Write a file only its owner can read (payloads and results may hold private data)."""
        with open(os.open(self.join(name), _CREATE, 0o600), "wb") as f:
            f.write(data)

    def save_checkpoint(self, epoch: int, write: Callable[[IO[bytes]], object], keep: Optional[int] = None,
                        best: bool = False) -> str:
        """Write the checkpoint of ``epoch`` with ``write(file)`` (owner-only: it is unpickled on
        resume; never torn: written aside, then renamed) and make it the latest (and the best, with
        ``best``); then keep only the ``keep`` of the highest epochs, the latest and the best
        (``keep`` None: every one). Its path."""
        os.makedirs(self.checkpoint_dir, mode=0o700, exist_ok=True)
        path = self.checkpoint_path(epoch)
        try:
            os.unlink(path + ".tmp")  # left by a crash mid-save
        except FileNotFoundError:
            pass
        with self.open_private(path + ".tmp", "wb") as f:
            write(f)
        os.replace(path + ".tmp", path)
        for marker in (self.LATEST, self.BEST) if best else (self.LATEST,):
            name = os.path.join(self.checkpoint_dir, marker)
            try:
                os.unlink(name + ".tmp")  # left by a crash mid-save
            except FileNotFoundError:
                pass
            with self.open_private(name + ".tmp", "wb") as f:  # owner-only, as every file of a run
                f.write(os.path.basename(path).encode())
            os.replace(name + ".tmp", name)
        if keep is not None:
            self.prune_checkpoints(keep)
        return path

    def checkpoints(self) -> list[str]:
        """The paths of the checkpoints saved, lowest epoch first."""
        try:
            names = os.listdir(self.checkpoint_dir)
        except OSError:
            return []
        found = [(int(m.group(1)), n) for m, n in ((_CHECKPOINT.fullmatch(n), n) for n in names) if m]
        return [os.path.join(self.checkpoint_dir, n) for _, n in sorted(found)]

    def best_checkpoint(self) -> Optional[str]:
        """The path of the checkpoint saved as the best (None if none was)."""
        return _named_checkpoint(self.checkpoint_dir, self.BEST)

    def prune_checkpoints(self, keep: int) -> list[str]:
        """Remove every checkpoint but the ``keep`` of the highest epochs, the latest and the best;
        the paths removed."""
        spare = {self.latest_checkpoint(), self.best_checkpoint()}
        removed = []
        for path in self.checkpoints()[:-keep] if keep > 0 else self.checkpoints():
            if path not in spare:
                try:
                    os.unlink(path)
                    removed.append(path)
                except FileNotFoundError:
                    pass
        return removed

    def open_private(self, path: str, mode: str = "w") -> IO[Any]:
        """A new file only its owner can read (stack dumps, checkpoints), never through a link."""
        return open(os.open(path, _CREATE, 0o600), mode)

    def append_private(self, path: str, text: str) -> None:
        """Append to a file only its owner can read (created so), never through a link."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
        with open(os.open(path, flags, 0o600), "a") as f:
            f.write(text)

    def read_result(self) -> Optional[bytes]:
        """The pickled result, from a run directory only this user could have written."""
        check_private_folder(self.path, "the run directory")
        return self.read_private(self.RESULT)

    def read_private(self, name: str) -> Optional[bytes]:
        """A file of the run written by ``write_private`` (None when absent), never through a link;
        check the folder with ``check_private_folder`` before unpickling it."""
        try:
            fd = os.open(self.join(name), os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError as e:  # ELOOP: a link where the package writes files
            raise UnsafeRunDirError(f"{self.join(name)!r} cannot be read: {e.strerror}; the package never "
                                    "writes a link there") from None
        with open(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if hasattr(os, "getuid") and st.st_uid not in (os.getuid(), 0):
                raise UnsafeRunDirError(f"{self.join(name)!r} belongs to {_who(st.st_uid)}, not to you: it is "
                                        "not read")
            return f.read()

    def remove(self, *names: str) -> None:
        """Remove files of the run (those already gone are fine)."""
        for name in names:
            try:
                os.unlink(self.join(name))
            except OSError:
                pass

    def latest_checkpoint(self) -> Optional[str]:
        return latest_checkpoint(self.checkpoint_dir)

    def first_event(self) -> Optional[dict[str, Any]]:
        """The first event of the log (the run's start: what the run is), read alone; None when
        there is none that reads as an event."""
        try:
            with open(self.events_path, "rb") as f:
                line = f.readline(4 * 2**20)
            event = json.loads(line) if line.endswith(b"\n") else None
        except (OSError, ValueError):
            return None
        return event if isinstance(event, dict) else None
