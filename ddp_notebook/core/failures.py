"""Failures as data: one ``WorkerFailure`` per failed worker, rendered in one place.

Pure Python; the supervisor builds these, the exception and every front end render them.

>>> f = WorkerFailure(rank=1, device="cpu:1", kind=FailureKind.EXCEPTION, time=0.0,
...                   exc_type="ValueError", message="boom")
>>> f.headline()
'Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom'
"""
from __future__ import annotations

import os
import time as _time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

from ._text import TextEnum
from .tracebacks import file_name, name_cells_in

__all__ = ["WorkerFailure", "FailureKind", "Phase", "SILENT_KINDS", "worker_name", "ranks_text", "order_failures",
           "render_failure_report", "failure_from_error", "is_runner_file", "format_locals"]


class FailureKind(TextEnum):
    """How a worker failed (the values of ``WorkerFailure.kind``)."""

    #: The function raised.
    EXCEPTION = "exception"
    #: The function or its arguments could not be loaded in the worker.
    UNPICKLE = "unpickle"
    #: Device or process-group set-up raised.
    INIT = "init"
    #: The return value could not be sent back.
    RESULT = "result"
    #: Killed by a signal without reporting (SIGKILL, SIGSEGV, ...).
    SIGNAL = "signal"
    #: Exited with a code without reporting (os._exit, sys.exit in C code, ...).
    EXIT = "exit"
    #: Made no progress while its peers waited for it.
    STALL = "stall"
    #: The ipyparallel engine running the rank died.
    ENGINE = "engine"
    #: The fork server that forked the worker died, and Linux ended the worker with it.
    SERVER = "server"
    #: The rank's host dropped off the network (its engine unreachable, its link gone).
    NETWORK = "network"


# Deaths without a report: the dead worker closed its sockets before any peer could notice, so
# it is the cause even when a peer's knock-on error was read first.
SILENT_KINDS = frozenset({FailureKind.SIGNAL, FailureKind.EXIT, FailureKind.ENGINE, FailureKind.SERVER,
                          FailureKind.NETWORK})


class Phase(TextEnum):
    """Where a worker was when it failed."""

    #: Before the function and its arguments were loaded.
    STARTUP = "startup"
    #: Loading the function and its arguments.
    UNPICKLE = "unpickle"
    #: Setting up the device and the process group.
    INIT = "init"
    #: In the function.
    RUN = "run"
    #: Sending the return value back.
    RESULT = "result"


_PHASE_KIND = {Phase.RUN: FailureKind.EXCEPTION, Phase.UNPICKLE: FailureKind.UNPICKLE, Phase.INIT: FailureKind.INIT,
               Phase.STARTUP: FailureKind.INIT, Phase.RESULT: FailureKind.RESULT}


# Exceptions that a mistake in the code or its data raises on any device (a retry elsewhere would
# raise them again). Read from the type's name, which the worker reports; never from the message.
CODE_ERRORS = frozenset({"TypeError", "AttributeError", "NameError", "UnboundLocalError", "SyntaxError",
                         "IndentationError", "ImportError", "ModuleNotFoundError", "KeyError", "IndexError",
                         "ZeroDivisionError", "AssertionError", "NotImplementedError", "RecursionError",
                         "PicklingError", "UnpicklingError"})


def worker_name(rank: int) -> str:
    """``main worker`` for rank 0, ``worker N`` otherwise (burn's words)."""
    return "main worker" if rank == 0 else f"worker {rank}"


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 1``, ``ranks 0, 1``, ``no rank``: a session's ranks in its messages and views.

    >>> ranks_text([1]), ranks_text([1, 0]), ranks_text([])
    ('rank 1', 'ranks 0, 1', 'no rank')
    """
    if not ranks:
        return "no rank"
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, sorted(ranks)))


@dataclass
class WorkerFailure:
    """Everything known about one failed worker.

    ``consequence`` is True for a failure that followed the root cause (for instance a gloo
    "Connection reset by peer" in a peer of the worker that died).
    """

    rank: int
    """The worker's rank."""
    device: str
    """Its device, such as ``"cpu:1"`` (with ``" on engine N"`` for a rank on an ipyparallel engine)."""
    kind: FailureKind
    """How it failed: an exception, a signal, an exit, a stall... (:class:`~ddp_notebook.core.failures.FailureKind`)."""
    time: float
    """When the failure was seen (seconds since the epoch)."""
    pid: Optional[int] = None
    """The worker's process id (None when it never started)."""
    phase: Phase = Phase.RUN
    """Where the worker was: start-up, loading the call, setting up, in the function, sending the result."""
    exc_type: Optional[str] = None
    """The exception's type name, such as ``"ValueError"`` (None for a death without one)."""
    message: str = ""
    """The exception's message, or what is known of a death or a stall."""
    traceback: str = ""
    """The worker's traceback (for a stall: its Python stack, or every rank's)."""
    exit_code: Optional[int] = None
    """The process's exit code, for a worker that exited without reporting."""
    signal: Optional[str] = None
    """The signal's name (``"SIGKILL"``, ``"SIGSEGV"``...) for a worker killed by one."""
    consequence: bool = False
    """True for a failure that only followed the root cause (shown as "knock-on")."""
    knock_on: bool = False
    """The worker said it failed because the run had already ended: never the root cause."""
    stalled_for: Optional[float] = None
    """For a stall: seconds without progress when the watchdog decided."""
    peers_waited: Optional[bool] = None
    """For a stall: whether another worker waited for it in a collective."""
    last_step: Optional[int] = None
    """The last step the worker reported (None if it reported none)."""
    stderr_tail: list[str] = field(default_factory=list)
    """The last lines the worker wrote to stderr."""
    # On the root cause when every worker raised this same error: their devices, in rank order.
    # Such an error is the run's, not one worker's: it comes from the code or the data.
    same_on: list[str] = field(default_factory=list)
    """On the root cause when every worker failed the same way: their devices, in rank order."""
    # The run's number for this failure (1, 2, ...): a failure judged again (a cause found to be a
    # consequence) is recorded again under the same id. 0: not numbered (written by hand).
    id: int = 0
    """The run's number for this failure (1, 2, ...; 0 when not numbered)."""
    locals: dict[str, str] = field(default_factory=dict)
    """For an exception: the local variables of the innermost frame of user code when it was
    raised, name → one-line summary (``Tensor[64, 3, 28, 28] float32 cpu``, ``list of 3``)."""
    locals_frames: list[dict[str, Any]] = field(default_factory=list)
    """Where ``locals`` were, and the frames above it toward the function: ``{"function", "file",
    "line", "locals"}`` each, innermost first."""

    def __post_init__(self) -> None:
        self.kind = FailureKind(self.kind)  # from JSON, or written by hand as a string
        self.phase = Phase(self.phase)

    @property
    def is_main(self) -> bool:
        """True for the main worker (rank 0)."""
        return self.rank == 0

    @property
    def from_code(self) -> bool:
        """True when the code or its data is the cause, not a device: the same error on every
        worker, a return value that cannot be sent back, a function or argument the workers
        cannot load, or an exception such as ``TypeError`` that any device would raise. A retry on
        other devices would fail the same way: the fix is in the code.

        >>> WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="TypeError").from_code
        True
        >>> WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, exc_type="ValueError").from_code
        False
        """
        if self.same_on and self.kind != FailureKind.STALL:
            return True
        if self.kind in (FailureKind.RESULT, FailureKind.UNPICKLE):
            return True
        return self.kind == FailureKind.EXCEPTION and self.exc_type in CODE_ERRORS

    def locals_title(self, name_file: Any = os.path.basename) -> str:
        """``Locals in train (train.py:12) on rank 1``: where ``locals`` were ("" when there are none).

        Parameters
        ----------
        name_file : callable, optional
            How a file is named (the notebook names a cell's file as IPython does).

        Returns
        -------
        str
            The title of the locals' table.
        """
        if not self.locals_frames:
            return ""
        top = self.locals_frames[0]
        where = f"{name_file(str(top.get('file')))}:{top.get('line')}"
        return f"Locals in {top.get('function')} ({where}) on rank {self.rank}"

    def summary(self) -> str:
        """What went wrong, in one line (the part after "failed: ").

        Returns
        -------
        str
            Such as ``ValueError: boom`` or ``killed by signal SIGKILL (often the out-of-memory killer: ...)``.
        """
        exc = f"{self.exc_type}: {self.message}" if self.message else (self.exc_type or "")
        kind = self.kind
        if kind == FailureKind.EXCEPTION:
            return exc
        if kind == FailureKind.UNPICKLE:
            return f"the function or its arguments could not be unpickled in the worker: {exc}"
        if kind == FailureKind.INIT:
            return f"setting up the device or process group failed: {exc}"
        if kind == FailureKind.RESULT:
            return f"the return value could not be sent back to the notebook: {exc}"
        when = " during start-up, before running the function" if self.phase == Phase.STARTUP else ""
        if kind == FailureKind.SIGNAL:
            sig = self.signal or "an unknown signal"
            if sig == "SIGKILL":
                return (f"killed by signal SIGKILL{when} (often the out-of-memory killer: "
                        "check the memory use of the data, model and batch size)")
            if sig == "SIGSEGV":
                return f"crashed with a segmentation fault (SIGSEGV){when}"
            return f"killed by signal {sig}{when}" + (f": {self.message}" if self.message else "")
        if kind == FailureKind.EXIT:
            return f"exited with code {self.exit_code}{when or ' before reporting a result'}"
        if kind == FailureKind.ENGINE:
            return (f"{self.message}{when}: the engine process ended (os._exit, a signal such as the out-of-memory "
                    "killer's SIGKILL, or a crash in native code)")
        if kind == FailureKind.SERVER:
            return f"{self.message}{when}, and Linux ended the workers it had forked with it"
        if kind == FailureKind.NETWORK:
            return f"its host dropped off the network{when}: {self.message}"
        step = f" (last step {self.last_step})" if self.last_step is not None else ""
        if self.same_on:  # every rank waits in a collective for another: see lifecycle.stall
            return (f"deadlocked: each waits in a collective for another, no progress for "
                    f"{self.stalled_for or 0.0:.1f} s{step} ({self.message}); which one took the wrong turn "
                    "cannot be told from their stacks")
        if self.message:  # what it waits for is known (lifecycle.stall)
            return f"stalled: no progress for {self.stalled_for or 0.0:.1f} s{step}: {self.message}"
        why = ("while the other workers waited for it" if self.peers_waited is not False
               else "(no other worker was waiting for it)")
        return f"stalled: no progress for {self.stalled_for or 0.0:.1f} s{step} {why}"

    def headline(self) -> str:
        """``Distributed data parallel worker 1 (cpu:1) failed: ValueError: boom``, or for an error
        every worker raised, ``Every distributed data parallel worker (cpu:0, cpu:1) failed the same
        way: ValueError: boom``."""
        if self.same_on and self.kind == FailureKind.STALL:
            return f"Distributed data parallel workers ({', '.join(self.same_on)}) are {self.summary()}"
        if self.same_on:
            return (f"Every distributed data parallel worker ({', '.join(self.same_on)}) failed the same way: "
                    f"{self.summary()}")
        return f"Distributed data parallel {worker_name(self.rank)} ({self.device}) failed: {self.summary()}"

    def traceback_title(self) -> str:
        """What ``traceback`` holds: one worker's traceback or stack, or every worker's stack."""
        if self.same_on and self.kind == FailureKind.STALL:
            return "Where each worker waits:"
        return f"Traceback from {worker_name(self.rank)} ({self.device}), pid {self.pid}:"

    def covers(self, other: WorkerFailure) -> bool:
        """This root failure is the run's (``same_on``) and ``other`` is one of the workers it
        speaks for: shown once, through this one."""
        return bool(self.same_on) and other is not self and not other.consequence and other.device in self.same_on

    def same_error_as(self, other: WorkerFailure) -> bool:
        """Both workers reported the same error from the same place (compared whole, never by parts of
        the text). Deaths without a report are never "the same": nothing says why they died, unless
        the fork server they came from died (its death, named in ``message``, ended them all)."""
        if self.kind == FailureKind.SERVER:
            return (self.kind, self.message) == (other.kind, other.message)
        return (self.kind not in SILENT_KINDS and self.kind != FailureKind.STALL
                and (self.kind, self.phase, self.exc_type, self.message, self.traceback)
                == (other.kind, other.phase, other.exc_type, other.message, other.traceback))

    def to_dict(self) -> dict[str, Any]:
        """The failure as plain data (what the run's event log holds).

        Returns
        -------
        dict
            One key per field.
        """
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> WorkerFailure:
        """The failure ``to_dict`` gave (read back from a run's event log).

        Parameters
        ----------
        data : dict
            One key per field, as ``to_dict`` returns it.

        Returns
        -------
        WorkerFailure
            The failure.
        """
        return cls(**data)


def failure_from_error(event: dict[str, Any], device: str, pid: Optional[int],
                       last_step: Optional[int]) -> WorkerFailure:
    """The failure a worker's ``error`` event reports (its phase says which kind)."""
    phase = Phase(event.get("phase", Phase.RUN))
    frames = [f for f in event.get("locals") or [] if isinstance(f, dict) and isinstance(f.get("locals"), dict)]
    return WorkerFailure(rank=event["rank"], device=device, kind=_PHASE_KIND[phase],
                         time=event.get("time") or _time.time(), pid=pid, phase=phase,
                         exc_type=event.get("exc_type"), message=event.get("message", ""),
                         traceback=event.get("traceback", ""), last_step=last_step,
                         knock_on=bool(event.get("knock_on")), locals=dict(frames[0]["locals"]) if frames else {},
                         locals_frames=frames)


def order_failures(found: Sequence[WorkerFailure], world_size: int = 0) -> list[WorkerFailure]:
    """The root cause first, then the rest by time marked as consequences. The cause is the
    earliest silent death if there is one (see ``SILENT_KINDS``), else the earliest failure.
    When all ``world_size`` workers (more than one) reported the same error, it is the run's:
    the root says so (``same_on``) and the others are neither causes nor consequences, just
    the same.

    >>> a, b = (WorkerFailure(rank=r, device=f"cpu:{r}", kind="exception", time=r, exc_type="KeyError",
    ...                       message="'x'") for r in (1, 0))
    >>> [f.rank for f in order_failures([a, b], world_size=2)], b.headline()
    ([0, 1], "Every distributed data parallel worker (cpu:0, cpu:1) failed the same way: KeyError: 'x'")
    """
    silent = [f for f in found if f.kind in SILENT_KINDS]
    causes = [f for f in found if not f.knock_on] or list(found)  # a worker that said it is a knock-on is none
    root = min(silent or causes, key=lambda f: f.time)
    root.consequence = False  # (judged again with a failure seen later, it may have been one)
    rest = sorted((f for f in found if f is not root), key=lambda f: f.time)
    same = (world_size > 1 and sorted(f.rank for f in found) == list(range(world_size))
            and all(root.same_error_as(f) for f in rest))
    if same:
        root.same_on = [f.device for f in sorted(found, key=lambda f: f.rank)]
    for f in rest:
        # Ranks the stall watchdog blamed in the same look (one time) are causes together.
        blamed_with_root = f.kind == root.kind == FailureKind.STALL and f.time == root.time
        f.consequence = not same and not blamed_with_root
    return [root, *rest]


def format_locals(failure: WorkerFailure, name_file: Any = os.path.basename) -> list[str]:
    """The lines that show a failure's locals: a title, then ``name: summary`` per variable
    (the innermost frame of user code; none when the worker recorded none).

    >>> f = WorkerFailure(rank=1, device="cpu:1", kind="exception", time=0.0, locals={"x": "Tensor[3] float32 cpu"},
    ...                   locals_frames=[{"function": "train", "file": "/w/train.py", "line": 12,
    ...                                   "locals": {"x": "Tensor[3] float32 cpu"}}])
    >>> for line in format_locals(f): print(line)
    Locals in train (train.py:12) on rank 1:
      x = Tensor[3] float32 cpu
    """
    if not failure.locals_frames:
        return []
    width = max((len(n) for n in failure.locals), default=0)
    return [failure.locals_title(name_file) + ":"] + [f"  {n.ljust(width)} = {v}" for n, v in failure.locals.items()]


def render_failure_report(root: WorkerFailure, failures: Sequence[WorkerFailure], stderr_lines: int = 15) -> str:
    """The full text shown for a failed run: the root cause's traceback, its stderr tail,
    the knock-on failures, and the one-line headline last (where eyes land)."""
    name = f"{worker_name(root.rank)} ({root.device})"
    parts: list[str] = []
    if root.traceback:
        parts.append(root.traceback_title())
        parts.append(name_cells_in(root.traceback.rstrip("\n")))
    parts.extend(format_locals(root, file_name))
    tail = [line for line in root.stderr_tail if line.strip()][-stderr_lines:]
    if tail and root.kind != FailureKind.EXCEPTION:
        parts.append(f"Last lines of the stderr of {name}:")
        parts.extend("  " + line for line in tail)
    others = [f for f in failures if f is not root and not root.covers(f)]
    if others:
        parts.append("")
        for f in others:
            how = "as a consequence" if f.consequence else "as well"
            parts.append(f"Also: {worker_name(f.rank)} ({f.device}) failed {how}: {f.summary()}")
    parts.append("")
    parts.append(f"WorkerFailedError: {root.headline()}")
    return "\n".join(parts) + "\n"


# The worker side's runner: the two entry points and the code that calls the user's function.
RUNNER_FILES = tuple(os.path.join("ddp_notebook", "worker", name) for name in ("process.py", "engine.py", "execute.py"))


def is_runner_file(path: str) -> bool:
    """True for the files whose frames head every worker traceback and stack (the runner of a
    worker process or an engine) and mean nothing to users. A path test, not an import: the
    worker process's module runs as ``__main__`` (through runpy) and must not be imported first."""
    return path.endswith(RUNNER_FILES)
