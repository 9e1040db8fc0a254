"""Naming the straggler when a run stops making progress.

When no rank reports progress for a while, every live worker dumps its Python stacks
(faulthandler on a real-time signal, which works even while the thread is blocked in C code). A rank
whose main thread is inside torch's collective machinery is waiting for a peer; the others
are the stalled ones. Pure text processing here; the supervisor sends the signals.
"""
from __future__ import annotations

import functools
import importlib.util
import linecache
import os
import re
import sysconfig
import time
from collections.abc import Callable, Sequence
from typing import Optional

from ..core.failures import FailureKind, WorkerFailure, is_runner_file
from ..core.tracebacks import file_name
from .clock import REAL_CLOCK, Clock

__all__ = ["torch_dir", "dump_stacks", "stall_failures", "main_thread_stack",
           "is_waiting_in_collective", "pick_stalled", "format_stack", "quiet_notes", "user_site", "collective_name"]

_HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+)", re.IGNORECASE)
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.*)$')


@functools.lru_cache(maxsize=1)
def torch_dir() -> Optional[str]:
    spec = importlib.util.find_spec("torch")  # finds the package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.realpath(list(spec.submodule_search_locations)[0])


# Where a rank that waits for its peers sits: collectives, DDP's reducer, autograd's engine
# (DDP all-reduces gradients from backward hooks).
_WAITING_PARTS = (("distributed",), ("nn", "parallel"), ("autograd",))


def main_thread_stack(dump: str, main_ident: Optional[int]) -> list[tuple[str, int, str]]:
    """The frames (most recent first) of the main thread in a faulthandler dump."""
    want = f"0x{main_ident:016x}" if main_ident is not None else None
    blocks: dict[str, list[tuple[str, int, str]]] = {}
    current: Optional[str] = None
    first: Optional[str] = None
    for line in dump.splitlines():
        h = _HEADER.match(line)
        if h:
            current = h.group(2).lower()
            blocks.setdefault(current, [])
            first = first or current
            continue
        f = _FRAME.match(line)
        if f and current is not None:
            blocks[current].append((f.group("file"), int(f.group("line")), f.group("name")))
    if want is not None and want in blocks:
        return blocks[want]
    return blocks.get(first, []) if first else []


def format_stack(frames: Sequence[tuple[str, int, str]]) -> str:
    """A traceback-style text, most recent call last."""
    lines = ["Stack (most recent call last):"]
    runner = [i for i, (file, _, _) in enumerate(frames) if is_runner_file(file)]
    # The user's frames are those above the innermost runner frame (the worker's main(), or an
    # engine's run_rank under ipykernel's loop): everything below says nothing to users.
    for file, line, name in reversed(frames[: runner[0]] if runner else frames):
        lines.append(f'  File "{file}", line {line}, in {name}')
        source = linecache.getline(file, line).strip()
        if source:
            lines.append(f"    {source}")
    return "\n".join(lines) + "\n"


def is_waiting_in_collective(frames: Sequence[tuple[str, int, str]], torch_home: Optional[str] = None) -> bool:
    """True when the innermost frame is in torch.distributed, DDP or autograd."""
    if not frames:
        return False
    torch_home = torch_home or torch_dir()
    if torch_home is None:
        return False
    path = os.path.realpath(frames[0][0])
    if not path.startswith(torch_home + os.sep):
        return False
    parts = tuple(os.path.relpath(path, torch_home).split(os.sep))
    return any(parts[: len(p)] == p for p in _WAITING_PARTS)


def pick_stalled(waiting: dict[int, bool], steps: dict[int, Optional[int]]) -> list[int]:
    """The ranks to blame: those not waiting in a collective; when every rank waits (or
    none does), the ranks that got least far."""
    stalled = [r for r, w in sorted(waiting.items()) if not w]
    if stalled and len(stalled) < len(waiting):
        return stalled
    def reached(rank: int) -> int:
        step = steps.get(rank)
        return -1 if step is None else step

    lowest = min(reached(r) for r in waiting)
    return [r for r in sorted(waiting) if reached(r) == lowest]


def dump_stacks(files: dict[int, str], request: Callable[[], None], clock: Clock = REAL_CLOCK) -> dict[int, str]:
    """Ask each worker for its stacks (``request`` signals every one) and read them
    back from its stack file (rank -> path): this dump only, a file holds every dump of the run.

    The worker's faulthandler writes from its signal handler, asynchronously to us: read each
    file once it has grown and stopped growing (at most 2 s)."""
    before = {r: _size(path) for r, path in files.items()}
    request()
    sizes: dict[int, int] = {}
    deadline = clock.monotonic() + 2.0
    while clock.monotonic() < deadline:
        now_sizes = {r: _size(path) for r, path in files.items()}
        if all(now_sizes[r] > before[r] and sizes.get(r) == now_sizes[r] for r in files):
            break
        sizes = now_sizes
        clock.sleep(0.02)
    out = {}
    for r, path in files.items():
        try:
            with open(path, "rb") as f:
                f.seek(before[r])
                out[r] = f.read().decode(errors="replace")
        except OSError:
            out[r] = ""
    return out


def stall_failures(stacks: dict[int, str], main_ident: dict[int, int], steps: dict[int, Optional[int]],
                   idle: float, devices: dict[int, str], pids: dict[int, Optional[int]],
                   returned: Sequence[int] = (), now: Optional[float] = None) -> list[WorkerFailure]:
    """One STALL failure per rank to blame (the first is the root cause), from the stacks of
    the ranks still running (``stacks`` keys); ``returned``: the ranks that returned from the
    function meanwhile (a rank waiting in a collective may wait for them)."""
    torch_home = torch_dir()
    frames = {r: main_thread_stack(stacks.get(r, ""), main_ident.get(r)) for r in stacks}
    waiting = {r: is_waiting_in_collective(frames[r], torch_home) for r in stacks}
    now = time.time() if now is None else now
    blamed = pick_stalled(waiting, {r: steps.get(r) for r in stacks})
    found = [WorkerFailure(rank=r, device=devices[r], kind=FailureKind.STALL, time=now, pid=pids.get(r),
                           traceback=format_stack(frames[r]), stalled_for=idle, last_step=steps.get(r),
                           peers_waited=any(waiting[o] for o in stacks if o != r))
             for r in blamed]
    if returned:
        for failure in found:
            if waiting[failure.rank]:  # its partner in the collective is a rank that left the function
                who = ", ".join(map(str, returned))
                failure.message = (f"it waits in a collective ({call_site(frames[failure.rank], torch_home)}) for "
                                   f"worker{'s' if len(returned) > 1 else ''} {who}, which returned from the "
                                   "function: every rank must make the same collective calls, and a rank that "
                                   "returns early leaves its peers' next one without a partner")
    if len(stacks) > 1 and all(waiting.values()) and blamed == sorted(stacks):
        # Every rank waits in a collective for another, none behind the others: a deadlock of
        # collectives that do not match. Nothing tells which rank is wrong: say so, once, with
        # where each one waits.
        root = found[0]
        root.same_on = [devices[r] for r in blamed]
        root.message = ", ".join(f"rank {r} at {call_site(frames[r], torch_home)}" for r in blamed)
        root.traceback = "".join(f"rank {r} ({devices[r]}): {format_stack(frames[r])}" for r in blamed)
    return found


def call_site(frames: Sequence[tuple[str, int, str]], torch_home: Optional[str]) -> str:
    """Where the user's code called into torch: ``train.py:12 dist.all_reduce(t)``."""
    for file, line, _name in frames:  # innermost first: the first frame outside torch
        if torch_home is None or not os.path.realpath(file).startswith(torch_home + os.sep):
            source = linecache.getline(file, line).strip()
            return f"{file_name(file)}:{line}" + (f" `{source}`" if source else "")
    return "torch"


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


# A rank that used less than this share of a core between two looks is idle, not computing.
IDLE_CPU = 0.05


def cpu_idle(cpu_then: Optional[float], cpu_now: Optional[float], elapsed: float) -> Optional[bool]:
    """Whether a rank used under ``IDLE_CPU`` of a core between two readings of its CPU seconds
    ``elapsed`` seconds apart (asleep, blocked; a rank about to raise computes); None: unknown.

    >>> cpu_idle(1.0, 1.001, 0.1), cpu_idle(1.0, 1.08, 0.1), cpu_idle(None, 1.0, 0.1)
    (True, False, None)
    """
    if cpu_then is None or cpu_now is None:
        return None
    return cpu_now - cpu_then < IDLE_CPU * max(elapsed, 1e-3)


def stayed_idle(where_then: object, where_now: object, cpu_then: Optional[float], cpu_now: Optional[float],
                elapsed: float) -> bool:
    """Whether a rank stayed at one place (its stack, or a site in it) between two looks
    ``elapsed`` seconds apart using under ``IDLE_CPU`` of a core: frozen there, not working (a
    long backward computes). Where its CPU time is unknown, the place alone says it. The stall
    watchdog and a session's cell judge a rank left waiting with it.

    >>> stayed_idle("all_reduce", "all_reduce", 1.0, 1.01, 1.0), stayed_idle("all_reduce", "all_reduce", 1.0, 1.9, 1.0)
    (True, False)
    """
    if not where_now or where_then != where_now:
        return False
    return cpu_idle(cpu_then, cpu_now, elapsed) is not False
_NAMED_IN_NOTE = 4  # ranks a waiting rank's note names before "..."
# Frames of decorators around torch.distributed's functions (c10d_logger's ``wrapper``): the
# collective is the function they wrap.
_WRAPPERS = frozenset({"wrapper", "_wrapper", "inner", "decorate_context"})


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Folders whose files are no user's code: torch, this package, the standard library and
    the installed packages."""
    dirs = {os.path.dirname(os.path.dirname(os.path.realpath(__file__)))}  # ddp_notebook/
    torch_home = torch_dir()
    if torch_home is not None:
        dirs.add(torch_home)
    paths = sysconfig.get_paths()
    for key in ("stdlib", "platstdlib", "purelib", "platlib"):
        if paths.get(key):
            dirs.add(os.path.realpath(paths[key]))
    return tuple(sorted(d + os.sep for d in dirs))


def _is_library(file: str) -> bool:
    if file.startswith("<frozen "):
        return True
    return os.path.realpath(file).startswith(_library_dirs()) if not file.startswith("<") else False


def _in_torch(file: str, torch_home: Optional[str]) -> bool:
    return torch_home is not None and os.path.realpath(file).startswith(torch_home + os.sep)


def user_site(frames: Sequence[tuple[str, int, str]]) -> Optional[str]:
    """``train.py:12``: the innermost frame of the user's code (not torch, this package, the
    standard library or an installed package); the innermost frame when there is none.

    >>> import threading
    >>> user_site([(threading.__file__, 320, "wait"), ("/work/train.py", 12, "train")])
    'train.py:12'
    """
    if not frames:
        return None
    for file, line, _name in frames:
        if not _is_library(file):
            return f"{file_name(file)}:{line}"
    file, line, _name = frames[0]
    return f"{file_name(file)}:{line}"


def collective_name(frames: Sequence[tuple[str, int, str]], torch_home: Optional[str] = None) -> str:
    """What a rank waiting in torch waits in: the torch.distributed function called from outside
    torch (``all_reduce``, ``all_gather_object``), ``backward`` (DDP reduces gradients from
    autograd's hooks), or DistributedDataParallel's method."""
    torch_home = torch_home or torch_dir()
    inside = []
    for file, _line, name in frames:  # innermost first, up to the first frame outside torch
        if not _in_torch(file, torch_home):
            break
        inside.append((os.path.relpath(os.path.realpath(file), torch_home).split(os.sep), name))
    if not inside:
        return "a collective"
    parts, name = inside[0]
    if parts[0] == "autograd":
        return "backward"
    if parts[:2] == ["nn", "parallel"]:
        return f"DistributedDataParallel.{name}"
    called = [n for p, n in inside if p[0] == "distributed" and n not in _WRAPPERS]
    return called[-1] if called else name


def _ranks_text(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:_NAMED_IN_NOTE])) + (", ..." if len(ranks) > _NAMED_IN_NOTE else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"


def quiet_notes(frames: dict[int, list[tuple[str, int, str]]], cpu: dict[int, Optional[float]],
                returned: Sequence[int] = (), torch_home: Optional[str] = None) -> dict[int, str]:
    """Where each rank of a quiet run is, in a few words: ``{0: "waits in all_reduce
    (train.py:9) for rank 1", 1: "runs at train.py:12, 100 % CPU"}``. A rank in a collective
    waits for the ranks that are not in one (and those that returned from the function);
    ``cpu``: each rank's share of a core since the last look (None: unknown). A rank whose stack
    could not be read gets no note, unless its CPU use is known.

    >>> quiet_notes({1: [("/work/train.py", 12, "train")]}, {1: 1.0})
    {1: 'runs at train.py:12, 100 % CPU'}
    """
    torch_home = torch_home or torch_dir()
    waiting = {r: is_waiting_in_collective(f, torch_home) for r, f in frames.items()}
    waited_for = sorted({r for r, w in waiting.items() if not w} | set(returned))
    notes: dict[int, str] = {}
    for rank in sorted(frames):
        share = cpu.get(rank)
        use = f"{100 * share:.0f} % CPU" if share is not None else None
        site = user_site(frames[rank])
        if waiting[rank]:
            others = [r for r in waited_for if r != rank]
            gone = [r for r in others if r in returned]
            whom = ""
            if others:
                whom = f" for {_ranks_text(others)}" + (", which returned from the function"
                                                        if gone and len(gone) == len(others) else "")
            notes[rank] = f"waits in {collective_name(frames[rank], torch_home)} ({site}){whom}"
        elif site is None:
            if use is not None:
                notes[rank] = f"uses {use} (its stack could not be read)"
        else:
            innermost = frames[rank][0]  # in a library called from there: say which function
            inside = f" (in {innermost[2]})" if _is_library(innermost[0]) else ""
            verb = "is idle at" if share is not None and share < IDLE_CPU else "runs at"
            notes[rank] = f"{verb} {site}{inside}" + (f", {use}" if use is not None else "")
    return notes
