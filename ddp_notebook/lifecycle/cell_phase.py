"""A session's request (a cell, a push, a pull) as a phase of its run, judged by the run's own
supervisor (``lifecycle.supervisor``), on its thread and its injected clock: the ranks' answers
pass through it on their way to the session, and it judges the phase with the run's parts.

- **A rank that raised while others run**: after ``KNOCK_ON_WAIT`` the ranks still in the cell
  are interrupted (a knock-on, as a launch stops the others when one fails).
- **Settle**: once every rank asked has answered and one raised, the ranks outside the request
  must show they live (``Supervisor`` pings them) before that error is believed: a rank waiting
  for a peer that died raises too, and the death is the cause.
- **A rank left waiting in a collective that cannot complete** (a peer raised, finished the
  cell or is not in it): once some rank is out of the cell, the ranks still in it are looked at
  every ``PROBE_EVERY`` seconds (their stacks, as the stall watchdog dumps them, and their CPU
  time, as the transport reads it). A rank whose main thread waits in torch.distributed, DDP or
  autograd, at the same place in two looks in a row taken after the last rank left the cell,
  using almost no CPU between them (for ``SKIPPED_AFTER`` seconds when nobody asked it to
  leave), is left waiting: its process group cannot be trusted, the session forms it again.
- **A rank that does not leave an interrupted cell** within ``INTERRUPT_GRACE`` is stuck
  (native code); the session forms it again too.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Optional

from .stall import stayed_idle

__all__ = ["CellPhase", "Gathered", "Look", "KNOCK_ON_WAIT", "PROBE_AFTER", "PROBE_EVERY", "SKIPPED_AFTER",
           "INTERRUPT_GRACE", "ABANDON_GRACE"]

#: Seconds after a rank raised before the ranks still in the cell are interrupted.
KNOCK_ON_WAIT = 0.5
#: Seconds a rank stays in a cell that another rank is out of before it is looked at ...
PROBE_AFTER = 0.5
#: ... and then between two looks.
PROBE_EVERY = 1.0
#: Seconds a rank nobody asked to leave must wait in a collective that a rank out of the cell
#: would have to join before it is judged left waiting (a collective of a subgroup may be slow).
SKIPPED_AFTER = 5.0
#: Seconds the ranks get to leave an interrupted cell before the session is formed again ...
INTERRUPT_GRACE = 10.0
#: ... or, once the user asked again (a second Kernel → Interrupt), before they are given up on:
#: a quick double press must not give up on ranks that were leaving.
ABANDON_GRACE = 1.0
_LOOKS_KEPT = 600  # (10 minutes of them): since when a rank waits there


@dataclass
class Gathered:
    """How a request ended: the replies by rank (the session keeps them), and what was judged
    meanwhile (the run's supervisor fills the rest)."""

    replies: dict[int, dict] = field(default_factory=dict)
    #: The user interrupted it (Kernel → Interrupt, or ``Session.interrupt()``).
    interrupted: bool = False
    #: Interrupted a third time while it was being sent: the frame was not sent whole.
    abandoned: bool = False
    #: Ranks left waiting in a collective that cannot complete: rank → where (``all_reduce (cell 3:2)``).
    left_waiting: dict[int, str] = field(default_factory=dict)
    #: Seconds each rank in ``left_waiting`` had waited there when judged.
    waited: dict[int, float] = field(default_factory=dict)
    #: Ranks that did not leave an interrupted cell within ``INTERRUPT_GRACE``.
    stuck: list[int] = field(default_factory=list)
    #: ... or that the user gave up on (interrupted again) before they left it, or were seen waiting.
    given_up: bool = False
    #: Where each rank still in the cell was last seen waiting in a collective (``all_reduce (<ddp cell 3>:2)``).
    places: dict[int, str] = field(default_factory=dict)
    #: The run ended while the request was in flight.
    gone: bool = False
    #: Set once the phase is judged (or the run ended).
    ended: threading.Event = field(default_factory=threading.Event, repr=False, compare=False)

    @property
    def raised(self) -> list[int]:
        """The ranks whose reply is an error they raised (not one asked to leave: interrupted)."""
        return [r for r, m in self.replies.items() if m["op"] == "error" and not m.get("interrupted")]

    @property
    def cut(self) -> bool:
        """True when some rank is still in the request: the session cannot go on with it."""
        return bool(self.left_waiting or self.stuck or self.abandoned)


@dataclass(frozen=True)
class Look:
    """The ranks still in a cell, looked at once: where each waits in a collective (its name
    and the user's line; empty: it does not) and its CPU seconds (None: unknown)."""

    at: float
    places: dict[int, tuple[str, ...]]
    cpu: dict[int, Optional[float]]


class CellPhase:
    """One request in flight, as the supervisor judges it: its thread calls everything but
    ``interrupt`` and ``abandon`` (the session's thread: the user pressed Interrupt), which
    ``wake`` the supervisor."""

    def __init__(self, request_id: int, cell: Optional[int], ranks: list[int], world_size: int, now: float,
                 wake: Callable[[], None] = lambda: None) -> None:
        self.id, self.cell, self.ranks, self.world_size = request_id, cell, list(ranks), world_size
        self.outcome = Gathered()
        self.wake = wake
        self.replied: dict[int, str] = {}  # rank → done, error, interrupted
        self.first_error: Optional[float] = None
        self.interrupt_sent: Optional[float] = None
        self.out_since: Optional[float] = None  # since when some rank is out of the cell
        self.left_at = now  # when the last rank left it (answered)
        self.next_look = 0.0
        self.looks: list[Look] = []
        self.asked = 0  # interrupts the user asked for
        self._taken = 0
        self.abandon_asked = False
        self._abandon_at: Optional[float] = None  # when the supervisor saw the user stop waiting

    # ---- the session's thread -------------------------------------------------------------------
    def interrupt(self) -> None:
        """The user asked to interrupt: the ranks still in the cell are asked to leave it."""
        self.asked += 1
        self.wake()

    def abandon(self) -> None:
        """The user stopped waiting (asked again): the ranks still in the request are stuck."""
        self.abandon_asked = True
        self.wake()

    # ---- the supervisor's thread ----------------------------------------------------------------
    def waiting(self) -> list[int]:
        """The ranks asked that have not answered."""
        return [r for r in self.ranks if r not in self.replied]

    def outside(self) -> list[int]:
        """The ranks the request was not sent to."""
        return [r for r in range(self.world_size) if r not in self.ranks]

    def answered(self, rank: int, op: str, interrupted: bool, now: float) -> None:
        """``rank`` answered the request: ``done``, or ``error`` (``interrupted``: it left when asked)."""
        if rank not in self.ranks or rank in self.replied:
            return
        self.replied[rank] = "interrupted" if op == "error" and interrupted else op
        # Looks before this moment judge nothing: the ranks still in the cell may have waited for
        # this one, and be about to leave too.
        self.left_at = now
        self.next_look = min(self.next_look, now + PROBE_AFTER) if self.out_since is not None else 0.0
        if op == "error" and not interrupted and self.first_error is None:
            self.first_error = now

    def to_interrupt(self, now: float) -> list[int]:
        """The ranks to interrupt now (the user asked, or ``KNOCK_ON_WAIT`` after a rank raised);
        a push or a pull cannot be left midway: it is only marked interrupted."""
        asked = self.asked > self._taken
        self._taken = self.asked
        if asked:
            self.outcome.interrupted = True
        knock_on = self.first_error is not None and now - self.first_error >= KNOCK_ON_WAIT
        if self.cell is None or self.interrupt_sent is not None or not (asked or knock_on) or not self.waiting():
            return []
        self.interrupt_sent = now
        return self.waiting()

    def stuck(self, now: float) -> bool:
        """True when the ranks still in the request are to be given up on: asked to leave
        ``INTERRUPT_GRACE`` ago, or ``ABANDON_GRACE`` after the user stopped waiting (they are
        ``outcome.stuck``)."""
        if self.abandon_asked and self._abandon_at is None:
            self._abandon_at = now
        given_up = self._abandon_at is not None and now - self._abandon_at >= ABANDON_GRACE
        if given_up or (self.interrupt_sent is not None and now - self.interrupt_sent >= INTERRUPT_GRACE):
            self.outcome.stuck, self.outcome.given_up = self.waiting(), given_up
            return True
        return False

    def look_due(self, now: float) -> list[int]:
        """The ranks to look at now (none: no look is due)."""
        waiting = self.waiting()
        if self.cell is None or not waiting:
            return []
        if len(waiting) == self.world_size and self.interrupt_sent is None:
            self.out_since = None  # every rank is in the cell: a collective among them can complete
            return []
        if self.out_since is None:
            self.out_since = now
            self.next_look = now + PROBE_AFTER
        if now < self.next_look:
            return []
        self.next_look = now + PROBE_EVERY
        return waiting

    def looked(self, look: Look) -> None:
        """Keep a look at the ranks still in the cell."""
        self.looks.append(look)
        del self.looks[:-_LOOKS_KEPT]
        for rank, place in look.places.items():
            if place:
                self.outcome.places[rank] = f"{place[0]} ({place[1]})"
            else:
                self.outcome.places.pop(rank, None)

    def left_waiting(self, now: float) -> bool:
        """True when every rank still in the cell waits in a collective, at the same place in the
        last two looks (both after the last rank left it), idle between them, and some rank is
        out of the cell (or, when nobody asked them to leave, has been for ``SKIPPED_AFTER``):
        ``outcome.left_waiting`` and ``outcome.waited`` say where and how long."""
        waiting = self.waiting()
        # Every rank still in the cell after it was interrupted: one waiting there waits for ever.
        if not waiting or self.out_since is None or len(self.looks) < 2 or \
                (len(waiting) == self.world_size and self.interrupt_sent is None):
            return False
        if self.interrupt_sent is None and now - self.out_since < SKIPPED_AFTER:
            return False
        before, last = self.looks[-2:]
        if before.at <= self.left_at:  # seen before the last rank left the cell: it may have waited for that one
            return False
        if self.interrupt_sent is not None and before.at <= self.interrupt_sent:  # it may be leaving
            return False
        elapsed = max(last.at - before.at, 0.1)
        if not all(stayed_idle(before.places.get(r), last.places.get(r), before.cpu.get(r), last.cpu.get(r), elapsed)
                   for r in waiting):
            return False  # one works (a long backward alone, say), or moved: not left waiting
        out = [r for r in range(self.world_size) if r not in waiting]
        for rank in waiting:
            name, site = last.places[rank]
            self.outcome.left_waiting[rank] = f"{name} ({site})" + for_whom(out, self.replied, self.ranks)
            since = now
            for look in reversed(self.looks):  # the looks at that place, in a row
                if look.places.get(rank) != last.places[rank]:
                    break
                since = look.at
            self.outcome.waited[rank] = now - since  # seen waiting there at least this long
        return True

    def deadline(self) -> Optional[float]:
        """When the phase next needs the supervisor (a knock-on, a look, the end of a grace)."""
        times = []
        if self.first_error is not None and self.interrupt_sent is None:
            times.append(self.first_error + KNOCK_ON_WAIT)
        if self.interrupt_sent is not None:
            times.append(self.interrupt_sent + INTERRUPT_GRACE)
        if self.abandon_asked:
            times.append(self._abandon_at + ABANDON_GRACE if self._abandon_at is not None else 0.0)
        waiting = self.waiting()
        if self.cell is not None and waiting and (len(waiting) < self.world_size or self.interrupt_sent is not None):
            times.append(self.next_look if self.out_since is not None else 0.0)
        return min(times) if times else None


def for_whom(out: list[int], replied: dict[int, str], asked: list[int]) -> str:
    """`` while rank 1 had raised``: what the ranks out of the cell did (which of them the
    collective waits for, its group says, not the notebook).

    >>> for_whom([1, 2, 3], {1: "error", 2: "done", 3: "done"}, [0, 1, 2, 3])
    ' while rank 1 had raised and ranks 2, 3 had finished the cell'
    >>> for_whom([1, 2], {1: "interrupted"}, [0, 1])
    ' while rank 1 had been interrupted and rank 2 does not run the cell'
    """
    groups: dict[str, list[int]] = {}
    for rank in out:
        how = replied.get(rank)
        what = ("do not run the cell" if rank not in asked else "are still in the cell") if how is None else \
            {"done": "had finished the cell", "interrupted": "had been interrupted"}.get(how, "had raised")
        groups.setdefault(what, []).append(rank)
    parts = []
    for what, ranks in groups.items():
        if len(ranks) == 1:
            what = what.replace("do not", "does not").replace("are still", "is still")
            parts.append(f"rank {ranks[0]} {what}")
        else:
            parts.append(f"ranks {', '.join(map(str, ranks))} {what}")
    return " while " + " and ".join(parts) if parts else ""
