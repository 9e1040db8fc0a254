"""The stall watchdog: when a run makes no progress, decide whether a rank hangs, and name it.

Two modes, chosen with ``stall_timeout``:

- a number of seconds (strict): no progress from any rank for that long, counted from the moment
  every rank called the function, fails the run. What users ask for when they know their loop
  reports often.
- ``"auto"`` (the default): it must never fail a healthy run, including code that never calls
  ``ctx.log`` and phases that are slow for good reasons (an evaluation on rank 0 while the others
  wait at a barrier). After a quiet period of ``max(floor, 20 x the usual gap between reports)``
  (floor 300 s, ``$DDP_NOTEBOOK_STALL_FLOOR``), every live rank's stack is sampled twice, a couple
  of seconds apart. The run fails only when a rank waits for its peers in a collective and every
  rank it could be waiting for is frozen: the same stack in both samples and (where the executor
  can tell) no CPU time spent. Anything else is work in progress: the panel shows "no progress
  for ..." and the watchdog looks again one quiet period later.

Long before that, whatever the setting, a quiet run is described, never judged: after
``NOTE_AFTER`` seconds without progress (or 5 times the usual gap between reports), the ranks'
stacks and CPU use say where each one waits or runs (``quiet_notes``: "rank 0 waits in
all_reduce (train.py:9) for rank 1; rank 1 runs at train.py:12, 100 % CPU"), refreshed while
the quiet lasts and dropped when progress resumes.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional, Union

from ..core.failures import WorkerFailure
from ..core.switches import seconds_from_env
from ..executors.base import Transport
from .clock import REAL_CLOCK, Clock
from .stall import (
    dump_stacks,
    is_waiting_in_collective,
    main_thread_stack,
    quiet_notes,
    stall_failures,
    stayed_idle,
    torch_dir,
)

__all__ = ["Watchdog", "StallSetting", "AUTO", "auto_floor", "FLOOR_ENV", "NOTE_AFTER"]

AUTO = "auto"
StallSetting = Union[float, str, None]  # seconds, "auto" or None (off)
FLOOR_ENV = "DDP_NOTEBOOK_STALL_FLOOR"
DEFAULT_FLOOR = 300.0  # seconds: the auto watchdog never looks before this much quiet
GAP_FACTOR = 20.0  # ... nor before 20 times a rank's usual gap between two progress reports
SAMPLE_GAP = 2.0  # seconds between the two stack samples
FLUSH_WAIT = 0.5  # seconds the strict watchdog gives the ranks to send their held-back progress
NOTE_AFTER = 10.0  # seconds of quiet before the ranks' notes say where each one waits or runs ...
NOTE_GAP_FACTOR = 5.0  # ... and not before 5 times the usual gap between two progress reports
NOTE_CPU_WINDOW = 1.0  # seconds over which the first note's CPU use is measured
# The notes are refreshed every NOTE_REFRESH seconds, then every tenth of the quiet so far, at
# most every NOTE_REFRESH_MAX (each look appends a dump to every rank's stack file).
NOTE_REFRESH = 10.0
NOTE_REFRESH_MAX = 60.0


def auto_floor() -> float:
    """The auto watchdog's floor in seconds: ``$DDP_NOTEBOOK_STALL_FLOOR``, else 300."""
    return seconds_from_env(FLOOR_ENV, DEFAULT_FLOOR)


@dataclass
class _Sample:
    at: float
    frames: dict[int, list[tuple[str, int, str]]]
    stacks: dict[int, str]
    cpu: dict[int, Optional[float]]


class Watchdog:
    """Watches one run's progress for the supervisor (same thread): ``started``/``progressed``
    on events, ``deadline()`` for the supervisor's poll, ``check()`` when it passes."""

    def __init__(self, setting: StallSetting, floor: float, transport: Transport,
                 stack_file: Callable[[int], str], clock: Clock = REAL_CLOCK) -> None:
        self.clock = clock
        self.strict = setting if isinstance(setting, (int, float)) else None
        self.auto = setting == AUTO
        self.floor = floor
        self.transport = transport
        self.stack_file = stack_file
        self.quiet_since: Optional[float] = None  # the last progress, or the last rank's start
        self.gaps: dict[int, float] = {}  # each rank's usual gap between reports (moving average)
        self._last: dict[int, float] = {}
        self._next_look: Optional[float] = None
        self._first: Optional[_Sample] = None  # auto: the first of the two samples
        self._flushed = False  # strict: held-back progress asked for, the look comes next
        self.notes: dict[int, str] = {}  # where each rank waits or runs, while the run is quiet
        self._note_at: Optional[float] = None  # the next look for the notes
        self._note_cpu: Optional[tuple[float, dict[int, Optional[float]]]] = None  # (when, CPU seconds) last read

    @property
    def enabled(self) -> bool:
        return self.strict is not None or self.auto

    def started(self) -> None:
        """A rank called the function: the quiet period starts (again)."""
        self._reset(self.clock.monotonic())

    def progressed(self, rank: int) -> None:
        now = self.clock.monotonic()
        if rank in self._last:
            gap = now - self._last[rank]
            self.gaps[rank] = gap if rank not in self.gaps else 0.8 * self.gaps[rank] + 0.2 * gap
        self._last[rank] = now
        self._reset(now)

    def _reset(self, now: float) -> None:
        self.quiet_since = now
        self._first = None
        self._flushed = False
        self._next_look = now + self.limit()
        self.notes = {}
        self._note_cpu = None
        self._note_at = now + max(NOTE_AFTER, NOTE_GAP_FACTOR * max(self.gaps.values(), default=0.0))

    def limit(self) -> float:
        """Seconds of quiet before the watchdog looks."""
        if self.strict is not None:
            return float(self.strict)
        return max(self.floor, GAP_FACTOR * max(self.gaps.values(), default=0.0))

    def deadline(self) -> Optional[float]:
        return self._next_look if self.enabled and self.quiet_since is not None else None

    def check(self, alive: Sequence[int], steps: dict[int, Optional[int]], main_ident: dict[int, int],
              labels: dict[int, str], pids: dict[int, Optional[int]],
              returned: Sequence[int] = ()) -> tuple[list[WorkerFailure], dict[int, str]]:
        """The ranks to fail as stalled (the first is the cause), with the stacks that show it;
        nothing while the run may still be working. ``alive``: the ranks inside the function;
        ``returned``: those that returned from it (and wait for their peers)."""
        now = self.clock.monotonic()
        if not self.enabled or self._next_look is None or now < self._next_look or not alive:
            return [], {}
        assert self.quiet_since is not None
        idle = now - self.quiet_since
        if self.strict is not None and not self._flushed:
            # Held-back progress first (it names the true last step), then look.
            self.transport.request_flush(alive)
            self._flushed, self._next_look = True, now + FLUSH_WAIT
            return [], {}
        sample = self._sample(alive, main_ident)
        if self.strict is not None:
            return (stall_failures(sample.stacks, main_ident, steps, idle, labels, pids, returned, self.clock.time()),
                    sample.stacks)
        if self._first is None or set(self._first.frames) != set(alive):
            waiting = [r for r in alive if is_waiting_in_collective(sample.frames[r], torch_dir())]
            if waiting:  # someone waits for a peer: look again shortly, then decide
                self.transport.request_flush(alive)  # meanwhile: the held-back progress, for the report
                self._first, self._next_look = sample, now + SAMPLE_GAP
            else:  # nobody is blocked on a peer: work in progress, however long
                self._next_look = now + self.limit()
            return [], {}
        first, self._first = self._first, None
        if self._hung(first, sample):
            return (stall_failures(sample.stacks, main_ident, steps, idle, labels, pids, returned, self.clock.time()),
                    sample.stacks)
        self._next_look = now + self.limit()
        return [], {}

    def note_deadline(self) -> Optional[float]:
        """When the quiet notes are next due (None before any rank called the function)."""
        return self._note_at if self.quiet_since is not None else None

    def quiet_notes(self, alive: Sequence[int], main_ident: dict[int, int],
                    returned: Sequence[int] = ()) -> dict[int, str]:
        """Where each rank waits or runs while the run is quiet (empty while it progresses):
        looks at the ranks' stacks and CPU use when due, else the last look's notes. ``alive``:
        the ranks inside the function; ``returned``: those that returned (their peers may wait
        for them). Describes only: nothing here fails a run."""
        now = self.clock.monotonic()
        if self._note_at is None or self.quiet_since is None or now < self._note_at:
            return self.notes
        if not alive:
            self.notes, self._note_cpu, self._note_at = {}, None, now + NOTE_REFRESH
            return self.notes
        self._note_at = now + NOTE_REFRESH  # (set first: a look that fails is not retried at once)
        if self._note_cpu is None:  # the CPU use is a difference: read it once, look a moment later
            self._note_cpu, self._note_at = (now, self.transport.cpu_seconds(alive)), now + NOTE_CPU_WINDOW
            return self.notes
        sample = self._sample(alive, main_ident)
        then, before = self._note_cpu
        elapsed = max(now - then, 1e-3)  # (the sample reads the CPU time first, then the stacks)
        shares: dict[int, Optional[float]] = {}
        for rank in alive:
            a, b = before.get(rank), sample.cpu.get(rank)
            shares[rank] = (b - a) / elapsed if a is not None and b is not None else None
        self.notes = quiet_notes(sample.frames, shares, returned)
        self._note_cpu = (now, sample.cpu)
        idle = self.clock.monotonic() - self.quiet_since
        self._note_at = self.clock.monotonic() + min(NOTE_REFRESH_MAX, max(NOTE_REFRESH, idle / 10))
        return self.notes

    def sample(self, ranks: Sequence[int], main_ident: dict[int, int]) -> tuple[dict[int, list[tuple[str, int, str]]],
                                                                              dict[int, Optional[float]]]:
        """The main thread's frames of each of ``ranks`` (innermost first, from the stacks they
        dump) and its CPU seconds (None where the executor cannot tell): a look at them, as the
        watchdog takes one (a session's cell is judged with it too)."""
        sample = self._sample(ranks, main_ident)
        return sample.frames, sample.cpu

    def _sample(self, ranks: Sequence[int], main_ident: dict[int, int]) -> _Sample:
        cpu = self.transport.cpu_seconds(ranks)
        stacks = dump_stacks({r: self.stack_file(r) for r in ranks}, lambda: self.transport.request_stacks(ranks),
                             self.clock)
        frames = {r: main_thread_stack(stacks.get(r, ""), main_ident.get(r)) for r in ranks}
        return _Sample(self.clock.monotonic(), frames, stacks, cpu)

    def _hung(self, first: _Sample, second: _Sample) -> bool:
        """A rank waits in a collective, and every rank that does not is frozen (when all wait
        in collectives, all must be frozen: a deadlock)."""
        tdir = torch_dir()
        waiting = {r for r, frames in second.frames.items() if is_waiting_in_collective(frames, tdir)}
        if not waiting:
            return False
        others = [r for r in second.frames if r not in waiting] or list(second.frames)
        elapsed = max(second.at - first.at, 1e-3)

        return all(stayed_idle(first.frames.get(r), second.frames[r], first.cpu.get(r), second.cpu.get(r), elapsed)
                   for r in others)
