"""One request of a session in flight: sent to some ranks, their replies gathered, their output
shown, and what a launch guarantees kept while the notebook waits (``lifecycle.session`` is the
session's API; ``worker.session_loop`` the ranks' side).

- **Output** (``CellOutput``): each line named by its rank, written in batches (one write per
  stream per look, a few a second, under Jupyter's output rate limit) and bounded per request;
  the lines not shown are counted and said at the end (the run's output has them all). What a
  thread of the cell prints after the cell has ended is in the run's output only.
- **Interrupts**: while the request is in flight, Kernel → Interrupt (SIGINT) only counts
  (``interrupts_counted``), so it never lands between reading a rank's bytes and keeping them,
  nor in the middle of a frame sent; the exchange asks the ranks still in the cell to leave it.
- **A rank that raised while others run**: after ``KNOCK_ON_WAIT`` the ranks still in the cell
  are interrupted (a knock-on, as a launch stops the others when one fails).
- **A rank left waiting in a collective that cannot complete** (a peer raised, finished the
  cell or is not in it): ranks still in the cell are asked where they are (``where``); one whose
  main thread waits in torch.distributed, DDP or autograd, at the same place in two looks in a
  row taken after the last rank left the cell, using almost no CPU between them (for
  ``SKIPPED_AFTER`` seconds when nobody asked it to leave), is ``left_waiting``. Its process
  group cannot be trusted: the session forms it again.
- **A rank that does not leave an interrupted cell** within ``INTERRUPT_GRACE`` is ``stuck``
  (native code); the session forms it again too.
"""
from __future__ import annotations

import contextlib
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

from ..core.bounds import LINE_CHARS
from ..core.events import SESSION_ROUTED
from ..transfer import pickling
from ..worker.rank_display import DISPLAY_ID
from .stall import collective_name, is_waiting_in_collective, user_site

__all__ = ["CellOutput", "Exchange", "Gathered", "RankGone", "ValueNotSent", "loaded_value", "unsent_error",
           "Answers", "Tell", "answer_of", "split", "hellos",
           "interrupts_counted", "SHOWN_LINES", "SHOWN_CHARS",
           "SHOWN_DISPLAYS",
           "INTERRUPT_GRACE", "KNOCK_ON_WAIT", "SETTLE_WAIT", "PROBE_AFTER", "PROBE_EVERY", "SKIPPED_AFTER", "IDLE_CPU"]

#: Lines of the ranks' output one request shows (all ranks together); the rest are counted.
SHOWN_LINES = 2000
#: Characters of the ranks' output one request shows (all ranks together).
SHOWN_CHARS = 512 * 1024
#: Displays (``display()``, figures) one request shows (all ranks together); the rest are counted.
SHOWN_DISPLAYS = 200
#: Seconds the ranks get to leave an interrupted cell before the session is formed again.
INTERRUPT_GRACE = 10.0
#: Seconds the run's supervisor gets to settle once a rank in a request raised (milliseconds,
#: up to its ``PROOF_WAIT`` for the ranks outside the request to show they live).
SETTLE_WAIT = 10.0
#: Seconds after a rank raised before the ranks still in the cell are interrupted.
KNOCK_ON_WAIT = 0.5
#: Seconds a rank stays in a cell that another rank is out of before it is asked where it is ...
PROBE_AFTER = 0.5
#: ... and then between two asks.
PROBE_EVERY = 1.0
#: Seconds a rank nobody asked to leave must wait in a collective that a rank out of the cell
#: would have to join before it is judged left waiting (a collective of a subgroup may be slow).
SKIPPED_AFTER = 5.0
#: Share of a core a rank may use between two looks and still be judged waiting: a rank blocked
#: in a collective uses none (0.000 measured); one computing gets far more, even on a busy machine.
IDLE_CPU = 0.02
_POLL = 0.1
_SAMPLES_KEPT = 600  # looks kept per rank (10 minutes of them): since when it waits there

#: Where a session's run puts what its ranks send the session: (rank, event, attachment), and
#: (rank, ``{"op": "exited"}``, None) when a rank ends.
Answers = queue.SimpleQueue[tuple[int, dict[str, Any], Any]]
#: How a request goes to ranks (``Run._tell``): (ranks, what routes it, the rest pickled, give up) →
#: the ranks it did not reach.
Tell = Callable[[list[int], dict[str, Any], Optional[bytes], Optional[Callable[[], bool]]], list[int]]


class RankGone(Exception):
    """A rank ended, or the session's run did, while the request was in flight."""


def split(message: dict[str, Any]) -> tuple[dict[str, Any], Optional[bytes]]:
    """A message as it travels: what routes it in the open, the rest pickled (None: no rest)."""
    rest = {k: v for k, v in message.items() if k not in SESSION_ROUTED}
    return {k: message[k] for k in SESSION_ROUTED if k in message}, (pickling.dumps(rest) if rest else None)


def answer_of(event: dict[str, Any], attachment: Any) -> dict[str, Any]:
    """A rank's answer whole again: what routed it, and its pickled rest (a ``Received``)."""
    answer = {k: event[k] for k in SESSION_ROUTED if k in event}
    if attachment is not None:
        answer.update(pickling.loads(attachment.data))
    return answer


class _Presses:
    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def interrupts_counted() -> Iterator[_Presses]:
    """While inside, SIGINT (Kernel → Interrupt, Ctrl-C) counts in the yielded object instead of
    raising ``KeyboardInterrupt`` at whatever line runs (a reply half read, a frame half sent).
    Off the main thread, or where SIGINT is not Python's to handle, nothing changes."""
    presses = _Presses()
    if threading.current_thread() is not threading.main_thread() or \
            not callable(signal.getsignal(signal.SIGINT)):
        yield presses
        return

    def count(signum: int, frame: Any) -> None:
        presses.count += 1

    previous = signal.signal(signal.SIGINT, count)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)


def hellos(answers: Answers, world: int, ended: Callable[[], bool]) -> Optional[dict[int, int]]:
    """Wait until every rank of a session just formed says hello: their pids by rank (None: the
    run ended first)."""
    pids: dict[int, int] = {}
    while len(pids) < world:
        if ended():
            return None
        try:
            rank, event, attached = answers.get(timeout=_POLL)
        except queue.Empty:
            continue
        if event.get("op") == "hello":
            pids[rank] = answer_of(event, attached).get("pid", 0)
    return pids


class CellOutput:
    """What the ranks print during one request, shown as it comes: each line named by its rank
    (``[rank 1] ...``), written in batches (one write per stream per ``flush``) and bounded
    (``SHOWN_LINES`` lines, ``SHOWN_CHARS`` characters, ``SHOWN_DISPLAYS`` displays, for all
    ranks together; each line cut at ``LINE_CHARS``).

    A line without its end yet (``end=''``, a progress bar) is shown at the next flush and goes
    on where it stopped; the pieces a rank's ``print`` writes in one go stay on one line. A
    carriage return (tqdm's bars) redraws the line, its rank named again, and only the last
    redraw of a flush is written. Another rank's text on the same stream starts a line of its own.

    >>> shown = []
    >>> out = CellOutput(lambda stream, text: shown.append(text), lines=2)
    >>> out.add(1, "stdout", "a\\nb\\nc\\nd")
    >>> out.flush(); out.close(); print("".join(shown), end="")
    [rank 1] a
    [rank 1] b
    [rank 1] 2 more lines not shown (session.current_run.output(1) has them)
    """

    def __init__(self, write: Optional[Callable[[str, str], None]] = None, lines: int = SHOWN_LINES,
                 chars: int = SHOWN_CHARS, display: Optional[Callable[..., None]] = None) -> None:
        self._write = write or _write_std
        self._display = display or _display_raw
        self._lines_left, self._chars_left = lines, chars
        self._open: dict[str, Optional[int]] = {"stdout": None, "stderr": None}  # the rank whose line is open
        self._column: dict[tuple[int, str], int] = {}  # characters of the open line shown
        self._skipping: set[tuple[int, str]] = set()  # a line shown cut: the rest of it is not shown
        # What a rank's line holds that is not shown yet, and whether a carriage return began it.
        self._partial: dict[tuple[int, str], tuple[str, bool]] = {}
        self._ready: dict[str, list[str]] = {"stdout": [], "stderr": []}
        self._hidden: dict[int, int] = {}
        self._displays_left = SHOWN_DISPLAYS
        self._hidden_displays: dict[int, int] = {}

    def add(self, rank: int, stream: str, text: str) -> None:
        """Take what ``rank`` printed on ``stream`` (any piece of text)."""
        stream = "stderr" if stream == "stderr" else "stdout"
        key = (rank, stream)
        for piece in _PIECES.findall(text):
            if piece in ("\n", "\r\n"):
                self._complete(rank, stream)
            elif piece == "\r":
                self._partial[key] = ("", True)  # what the line held and was not shown yet is drawn over
            else:
                pending, redraw = self._partial.get(key, ("", False))
                self._partial[key] = (pending + piece, redraw)
                if len(pending) + len(piece) > LINE_CHARS:  # long enough to be cut now
                    self._show_partial(rank, stream)

    def _show_partial(self, rank: int, stream: str) -> None:
        """Show what ``rank``'s line holds and was not shown yet (the line stays open)."""
        key = (rank, stream)
        text, redraw = self._partial.pop(key, ("", False))
        if not text and not redraw:
            return
        if not self._begin(rank, stream, redraw):
            return
        self._text(rank, stream, text)

    def _begin(self, rank: int, stream: str, redraw: bool) -> bool:
        """Make ``rank``'s line the open one of ``stream``, drawn anew when ``redraw``; False
        when the request's bounds are spent (the line is counted, not shown)."""
        key = (rank, stream)
        if self._open[stream] == rank:
            if redraw:
                self._skipping.discard(key)
                self._column[key] = 0
                if self._chars_left > 0:
                    self._put(stream, f"\r[rank {rank}] ")
            return key not in self._skipping
        return self._start(rank, stream)

    def _text(self, rank: int, stream: str, piece: str) -> None:
        key = (rank, stream)
        if key in self._skipping or not piece:
            return
        room = LINE_CHARS - self._column.get(key, 0)
        if len(piece) > room:
            piece = f"{piece[:room]}… [cut at {LINE_CHARS} characters: the run's output has the whole line]"
            self._skipping.add(key)
        elif len(piece) > self._chars_left:  # the request's bound: the rest of this line, and the lines after, counted
            piece = f"{piece[:max(self._chars_left, 0)]}…"
            self._skipping.add(key)
        self._column[key] = self._column.get(key, 0) + len(piece)
        self._put(stream, piece)

    def _start(self, rank: int, stream: str) -> bool:
        """Open a line of ``rank`` on ``stream`` (ending another rank's first); False when the
        request's bounds are spent: the line is counted, not shown."""
        if self._lines_left <= 0 or self._chars_left <= 0:
            self._lines_left = 0
            self._hidden[rank] = self._hidden.get(rank, 0) + 1
            self._end_open(stream)
            return False
        self._end_open(stream)
        self._lines_left -= 1
        self._open[stream] = rank
        self._column[(rank, stream)] = 0
        self._skipping.discard((rank, stream))
        self._put(stream, f"[rank {rank}] ")
        return True

    def _complete(self, rank: int, stream: str) -> None:
        """``rank``'s line ended: show what it held, then its end."""
        key = (rank, stream)
        text, redraw = self._partial.pop(key, ("", False))
        if self._begin(rank, stream, redraw):
            self._text(rank, stream, text)
        if self._open[stream] == rank:
            self._put(stream, "\n")
            self._open[stream] = None
        self._skipping.discard(key)
        self._column.pop(key, None)

    def _put(self, stream: str, text: str) -> None:
        self._chars_left -= len(text)
        self._ready[stream].append(text)

    def _end_open(self, stream: str) -> None:
        rank = self._open[stream]
        if rank is not None:
            self._put(stream, "\n")
            self._open[stream] = None
            self._column.pop((rank, stream), None)
            self._skipping.discard((rank, stream))

    def flush(self) -> None:
        """Write what was taken so far, lines without their end included: one write per stream."""
        for rank, stream in list(self._partial):
            self._show_partial(rank, stream)
        for stream, pieces in self._ready.items():
            if pieces:
                self._write(stream, "".join(pieces))
                pieces.clear()

    def display(self, rank: int, data: dict, metadata: dict, label: str = "") -> None:
        """Show what ``rank`` displayed (a MIME bundle: HTML, an image, a figure), after what it
        printed before, under a line that names the rank (``label`` after its name). A display
        the rank keeps current (``display_id``) is updated in place. At most ``SHOWN_DISPLAYS``
        a request; the rest are counted."""
        metadata = dict(metadata)
        kept = metadata.pop(DISPLAY_ID, None)
        display_id = f"ddp-rank{rank}-{kept.get('id')}" if isinstance(kept, dict) else None
        self.flush()  # what the ranks printed before, first
        if display_id is not None and isinstance(kept, dict) and kept.get("update"):
            self._display(data, metadata, display_id=display_id, update=True)
            return
        if not label:
            if self._displays_left <= 0:
                self._hidden_displays[rank] = self._hidden_displays.get(rank, 0) + 1
                return
            self._displays_left -= 1
        text = data.get("text/plain") if isinstance(data.get("text/plain"), str) else None
        self._end_open("stdout")
        if set(data) <= {"text/plain"} and display_id is None:  # text alone: lines named as printed ones are
            lines = (text or "").split("\n")
            self._put("stdout", "".join(f"[rank {rank}] {label if i == 0 else ''}{line}\n"
                                        for i, line in enumerate(lines)))
            self.flush()
            return
        self._put("stdout", f"[rank {rank}]{' ' + label.rstrip() if label else ''}\n")
        self.flush()
        self._display(data, metadata, display_id=display_id)

    def close(self) -> None:
        """End the lines still open, write the rest, then say what was not shown."""
        self.flush()
        for stream in self._ready:
            self._end_open(stream)
        self._skipping.clear()
        self.flush()
        for rank, count in sorted(self._hidden.items()):
            self._write("stderr", f"[rank {rank}] {count} more line{'' if count == 1 else 's'} not shown "
                                  f"(session.current_run.output({rank}) has them)\n")
        self._hidden.clear()
        for rank, count in sorted(self._hidden_displays.items()):
            self._write("stderr", f"[rank {rank}] {count} more display{'' if count == 1 else 's'} not shown "
                                  f"(a request shows {SHOWN_DISPLAYS})\n")
        self._hidden_displays.clear()


_PIECES = re.compile(r"\r\n|\r|\n|[^\r\n]+")


def _write_std(stream: str, text: str) -> None:
    out = sys.stderr if stream == "stderr" else sys.stdout
    out.write(text)
    out.flush()


def _display_raw(data: dict, metadata: dict, display_id: Optional[str] = None, update: bool = False) -> None:
    """Show a MIME bundle in the notebook (its text outside one); with ``display_id``, one that
    can be updated in place (``update``: this is its update)."""
    from IPython.display import display

    if display_id is None:
        display(data, metadata=metadata, raw=True)
    else:
        display(data, metadata=metadata, raw=True, display_id=display_id, update=update)


class ValueNotSent:
    """A rank's value that could not come to the notebook (a generator cannot be pickled; a
    DDP-wrapped model cannot be loaded outside its process group): in its place, its text as
    the rank computed it (its ``repr``, which this object's is), and why it stayed there.

    ``session.pull(name)`` raises for such a value; the rank's namespace still holds it.
    """

    def __init__(self, rank: int, text: str, reason: str, error: str = "") -> None:
        self.rank = rank
        self.text = text
        self.reason = reason
        self.error = error  # the type of the exception that kept it there

    def __repr__(self) -> str:
        return self.text


def loaded_value(rank: int, reply: dict[str, Any]) -> Any:
    """The value a rank's reply carries, loaded here; a :class:`ValueNotSent` when it could not
    be pickled there or loaded here; None when it carries none."""
    text = str(reply.get("text", ""))
    if "unsent" in reply:
        unsent = str(reply["unsent"])
        return ValueNotSent(rank, text, f"it cannot be pickled on rank {rank}: {unsent}", unsent.partition(":")[0])
    data = reply.get("value")
    if not isinstance(data, bytes):
        return None
    try:
        return pickling.loads(data)
    except Exception as exc:  # noqa: BLE001 - unpickling runs the value's own code: any error
        return ValueNotSent(rank, text, f"it cannot be loaded in the notebook: {type(exc).__name__}: "
                                        f"{str(exc) or repr(exc)}", type(exc).__name__)


def unsent_error(name: str, value: ValueNotSent) -> dict[str, Any]:
    """The error reply ``pull(name)`` makes of a value that could not come: pull is for objects."""
    text = " ".join(value.text.split())
    shown = text[:80] + "…" if len(text) > 80 else text
    return {"op": "error", "error": {
        "kind": "error", "phase": "result", "exc_type": value.error or "ValueNotSent", "time": 0.0,
        "message": f"{name!r} ({shown}): {value.reason} (it stays in rank {value.rank}'s namespace)"}}


@dataclass
class Gathered:
    """How a request ended: the replies by rank, and what the notebook had to do meanwhile."""

    replies: dict[int, dict] = field(default_factory=dict)
    #: The user interrupted it (Kernel → Interrupt, or ``Session.interrupt()``).
    interrupted: bool = False
    #: Interrupted again while it was being sent: the frame was not sent whole.
    abandoned: bool = False
    #: Ranks interrupted because another rank raised.
    knocked_on: list[int] = field(default_factory=list)
    #: Ranks left waiting in a collective that cannot complete: rank → where (``all_reduce (cell 3:2)``).
    left_waiting: dict[int, str] = field(default_factory=dict)
    #: Seconds each rank in ``left_waiting`` had waited there when judged.
    waited: dict[int, float] = field(default_factory=dict)
    #: Ranks that did not leave an interrupted cell within ``INTERRUPT_GRACE``.
    stuck: list[int] = field(default_factory=list)
    #: Where each rank still in the cell was last seen waiting in a collective (``all_reduce (<ddp cell 3>:2)``).
    places: dict[int, str] = field(default_factory=dict)

    @property
    def cut(self) -> bool:
        """True when some rank is still in the request: the session cannot go on with it."""
        return bool(self.left_waiting or self.stuck or self.abandoned)


class Exchange:
    """Send one request to ``ranks`` and gather their replies (``run()``), keeping the guarantees
    the module describes. ``record`` is the session's record (what its view reads)."""

    def __init__(self, tell: Tell, answers: Answers, settle: Callable[[list[int]], Optional[threading.Event]],
                 ranks: list[int], world_size: int, message: dict[str, Any], cell: Optional[int], record: Any,
                 run_done: Callable[[], bool], output: Optional[CellOutput] = None) -> None:
        self.tell, self.answers, self.settle = tell, answers, settle
        self.ranks, self.world_size = ranks, world_size
        self.message, self.cell, self.record = message, cell, record
        self.run_done = run_done
        self.output = output or CellOutput()
        self.outcome = Gathered()
        self._interrupt_sent: Optional[float] = None
        self._first_error: Optional[float] = None
        self._out_since: Optional[float] = None  # since when some rank is out of the cell
        self._left_at = 0.0  # when the last rank left it (replied)
        self._next_probe = 0.0
        self._probes = 0
        # rank → (probe, when, place, cpu seconds), the newest last
        self._samples: dict[int, list[tuple[int, float, tuple, Optional[float]]]] = {}

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> Gathered:
        """Send the request and wait for every reply, or until the request is cut.

        Raises
        ------
        RankGone
            A rank's socket closed or the run ended meanwhile.
        """
        with interrupts_counted() as presses:
            try:
                self._send(presses)
                if self.outcome.abandoned:
                    return self.outcome
                handled = 0
                while self._waiting():
                    self._pump()
                    self.output.flush()
                    now = time.monotonic()
                    pressed, handled = presses.count > handled, presses.count
                    if (pressed or self.record.interrupt_asked()) and self._asked_to_stop(now, presses.count):
                        self.outcome.stuck = self._waiting()  # asked again: do not wait for them
                        break
                    if self._first_error is not None and self._interrupt_sent is None and \
                            now - self._first_error >= KNOCK_ON_WAIT:
                        self.outcome.knocked_on = self._waiting()
                        self._interrupt(now)
                    self._probe(now)
                    if self._judge(now):
                        break
                    if self._interrupt_sent is not None and now - self._interrupt_sent > INTERRUPT_GRACE:
                        self.outcome.stuck = self._waiting()
                        break
                if self._first_error is not None and not self.outcome.cut:
                    self._settle()
            finally:
                self.output.close()
        return self.outcome

    def _settle(self) -> None:
        """A rank raised: before its error is believed, the run's supervisor makes visible what
        has already happened to the ranks, has the ranks outside the request show they live, and
        judges it (``Supervisor.request_settle``). A rank waiting for a peer that died (SIGKILL,
        out of memory) raises too, and the death is the cause, not that error: the death's
        verdict is the run's, and the rank's end reaches the answers (``RankGone``)."""
        done = self.settle([r for r in range(self.world_size) if r not in self.ranks])
        if done is not None:
            done.wait(SETTLE_WAIT)
        self._pump(timeout=0.0)

    def _asked_to_stop(self, now: float, presses: int) -> bool:
        """The user asked to interrupt: the first time, ask the ranks to leave the cell; True
        when it is time to stop waiting for them (asked again, or thrice for a push or a pull,
        which the ranks cannot leave midway)."""
        if self.cell is None:
            self.outcome.interrupted = True  # said when it ends
            return presses >= 3
        if self.outcome.interrupted and self._interrupt_sent is not None:
            return presses >= 2
        self.outcome.interrupted = True
        self._interrupt(now)
        return False

    def _waiting(self) -> list[int]:
        return [r for r in self.ranks if r not in self.outcome.replies]

    def _send(self, presses: _Presses) -> None:
        """Send the request to each rank whole; a second interrupt while it is sent abandons it."""
        try:
            header, body = split(self.message)
            missed = self.tell(self.ranks, header, body, lambda: presses.count >= 2 or self.run_done())
            if presses.count >= 2:
                self.outcome.abandoned = True
            elif missed:
                raise RankGone
        finally:
            self.outcome.interrupted = presses.count > 0

    def _pump(self, timeout: float = _POLL) -> None:
        """Wait up to ``timeout`` for what the ranks send and take each answer; a rank's end, or
        the run's, raises ``RankGone``."""
        got = []
        try:
            got.append(self.answers.get(timeout=timeout))
            while True:
                got.append(self.answers.get_nowait())
        except queue.Empty:
            pass
        for rank, event, attachment in got:
            if event.get("op") == "exited":
                raise RankGone
            self._take(rank, answer_of(event, attachment))
        if self.run_done():
            raise RankGone

    def _take(self, rank: int, reply: dict[str, Any]) -> None:
        op = reply.get("op")
        if op == "out":
            if reply.get("cell") == self.cell and self.cell is not None:  # an earlier cell's thread: the run has it
                self.output.add(rank, str(reply.get("stream")), str(reply.get("text")))
        elif op == "display" and reply.get("cell") == self.cell and self.cell is not None:
            data, metadata = reply.get("data"), reply.get("metadata")
            if isinstance(data, dict) and data:
                self.output.display(rank, data, metadata if isinstance(metadata, dict) else {})
        elif op == "where" and reply.get("cell") == self.cell and self.cell is not None:
            frames = [tuple(f) for f in reply.get("frames") or []]
            place = (collective_name(frames), user_site(frames)) if is_waiting_in_collective(frames) else ()
            cpu = reply.get("cpu") if isinstance(reply.get("cpu"), (int, float)) else None
            self._samples.setdefault(rank, []).append((self._probes, time.monotonic(), place, cpu))
            del self._samples[rank][:-_SAMPLES_KEPT]
            if place:
                self.outcome.places[rank] = f"{place[0]} ({place[1]})"
            else:
                self.outcome.places.pop(rank, None)
        elif op in ("done", "error") and reply.get("id") == self.message["id"]:
            # Looks before this moment judge nothing: the ranks still in the cell may have waited
            # for this one, and be about to leave too.
            self._left_at = time.monotonic()
            self._next_probe = min(self._next_probe, self._left_at + PROBE_AFTER) if self._out_since else 0.0
            self.outcome.replies[rank] = reply
            self.record.mark_replied(rank, op)
            if op == "error" and not reply.get("interrupted") and self._first_error is None:
                self._first_error = time.monotonic()

    def _interrupt(self, now: float) -> None:
        """Ask the ranks still in the cell to leave it (a SIGINT in each)."""
        if self._interrupt_sent is not None:
            return
        for rank in self._waiting():
            self._tell(rank, {"op": "interrupt", "cell": self.cell})
        self.record.mark_interrupting()
        self._interrupt_sent = now

    def _tell(self, rank: int, message: dict[str, Any]) -> None:
        self.tell([rank], message, None, None)  # small: sent whole, or the rank is gone (the pump says so)

    # ---- ranks left waiting ---------------------------------------------------------------------
    def _probe(self, now: float) -> None:
        """Ask the ranks still in the cell where they are, once some rank is out of it."""
        waiting = self._waiting()
        if self.cell is None or not waiting:
            return
        if len(waiting) == self.world_size and self._interrupt_sent is None:
            self._out_since = None  # every rank is in the cell: a collective among them can complete
            return
        if self._out_since is None:
            self._out_since = now
            self._next_probe = now + PROBE_AFTER
        if now < self._next_probe:
            return
        self._probes += 1
        self._next_probe = now + PROBE_EVERY
        for rank in waiting:
            self._tell(rank, {"op": "where", "cell": self.cell})

    def _judge(self, now: float) -> bool:
        """True when every rank still in the cell waits in a collective, at the same place in its
        last two looks, and some rank is out of the cell (or, when nobody asked them to leave, has
        been for ``SKIPPED_AFTER``)."""
        waiting = self._waiting()
        if not waiting or self._out_since is None or len(waiting) == self.world_size:
            return False
        if self._interrupt_sent is None and now - self._out_since < SKIPPED_AFTER:
            return False
        places = {}
        for rank in waiting:
            last = self._samples.get(rank, [])
            if len(last) < 2 or last[-1][0] != self._probes or not last[-1][2] or last[-1][2] != last[-2][2]:
                return False
            (_, then, _, cpu_then), (_, when, place, cpu_now) = last[-2:]
            if then <= self._left_at:  # seen before the last rank left the cell: it may have waited for that one
                return False
            if cpu_then is None or cpu_now is None or cpu_now - cpu_then > IDLE_CPU * max(when - then, 0.1):
                return False  # it works (a long backward alone, say): not waiting
            places[rank] = place
        out = sorted(set(range(self.world_size)) - set(waiting))
        for rank, (name, site) in places.items():
            self.outcome.left_waiting[rank] = f"{name} ({site})" + _for_whom(out, self.outcome.replies, self.ranks)
            since = now
            for _, when, place, _ in reversed(self._samples[rank]):  # the looks at that place, in a row
                if place != places[rank]:
                    break
                since = when
            self.outcome.waited[rank] = now - since  # seen waiting there at least this long
        return True


def _for_whom(out: list[int], replies: dict[int, dict], asked: list[int]) -> str:
    """`` while rank 1 had raised``: what the ranks out of the cell did (which of them the
    collective waits for, its group says, not the notebook).

    >>> _for_whom([1, 2, 3], {1: {"op": "error"}, 2: {"op": "done"}, 3: {"op": "done"}}, [0, 1, 2, 3])
    ' while rank 1 had raised and ranks 2, 3 had finished the cell'
    >>> _for_whom([1, 2], {1: {"op": "error", "interrupted": True}}, [0, 1])
    ' while rank 1 had been interrupted and rank 2 does not run the cell'
    """
    groups: dict[str, list[int]] = {}
    for rank in out:
        reply = replies.get(rank)
        if reply is None:
            what = "do not run the cell" if rank not in asked else "are still in the cell"
        elif reply["op"] == "done":
            what = "had finished the cell"
        else:
            what = "had been interrupted" if reply.get("interrupted") else "had raised"
        groups.setdefault(what, []).append(rank)
    parts = []
    for what, ranks in groups.items():
        if len(ranks) == 1:
            what = what.replace("do not", "does not").replace("are still", "is still")
            parts.append(f"rank {ranks[0]} {what}")
        else:
            parts.append(f"ranks {', '.join(map(str, ranks))} {what}")
    return " while " + " and ".join(parts) if parts else ""
