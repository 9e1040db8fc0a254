"""One request of a session in flight, as the notebook sees it: sent to some ranks, their
replies gathered, their output shown (``lifecycle.session`` is the session's API;
``worker.session_loop`` the ranks' side; the run's supervisor judges the request as a phase of
the run, ``lifecycle.cell_phase``: knock-ons, settling, ranks left waiting or stuck).

- **Output** (``CellOutput``): each line named by its rank, written in batches (one write per
  stream per look, a few a second, under Jupyter's output rate limit) and bounded per request;
  the lines not shown are counted and said at the end (the run's output has them all). What the
  ranks print outside any request (a thread of a cell that has ended) shows at once in the cell of
  the last request (``BetweenCells``).
- **Interrupts**: while the request is in flight, Kernel → Interrupt (SIGINT) only counts
  (``interrupts_counted``), so it never lands between reading an answer and keeping it, nor in
  the middle of a frame sent; the supervisor asks the ranks still in the cell to leave it. In the
  notebook's own part of a request (preparing it, loading what came back) it raises one line
  (``interrupts_said``); a quick second press is held (``hold_presses``).
- **Routing** (``answered``, ``on_run_event``): what the run's supervising thread hands the
  session goes to the request in flight, or, printed while none is, to ``BetweenCells``.
- **Travel**: requests and answers are frames of the run's transport, in the run's codec: what
  routes them in the open (``core.events.SESSION_ROUTED``), the rest pickled (``split``,
  ``answer_of``).
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Optional

from ..core.bounds import LINE_CHARS, escape_surrogates
from ..core.errors import SessionInterrupted
from ..core.events import DISPLAY_ID, SESSION_ROUTED, EventKind
from ..core.failures import ranks_text
from ..transfer import pickling
from .cell_phase import CellPhase, Gathered

__all__ = ["CellOutput", "BetweenCells", "Exchange", "Gathered", "RankGone", "ValueNotSent", "loaded_value",
           "unsent_error", "Answers", "Tell", "answer_of", "hellos",
           "interrupts_counted", "interrupts_said",
           "answered", "on_run_event", "hold_presses", "PRESS_HELD", "SHOWN_LINES", "SHOWN_CHARS",
           "SHOWN_DISPLAYS", "REDRAW_EVERY", "Begin"]

log = logging.getLogger(__name__)

#: Lines of the ranks' output one request shows (all ranks together); the rest are counted.
SHOWN_LINES = 2000
#: Characters of the ranks' output one request shows (all ranks together).
SHOWN_CHARS = 512 * 1024
#: Displays (``display()``, figures) one request shows (all ranks together); the rest are counted.
SHOWN_DISPLAYS = 200
_POLL = 0.1  # seconds between two looks at what the ranks sent
#: Seconds after an interrupted request during which another SIGINT is the same press, dropped.
PRESS_HELD = 1.0
#: Seconds between two redraws of a rank's line that another rank's line has ended since (a progress
#: bar on each rank): each such redraw is a line of its own, not drawn over.
REDRAW_EVERY = 2.0

#: Where a session's run puts what its ranks send the session: (rank, event, attachment), and
#: (rank, ``{"op": "exited"}``, None) when a rank ends.
Answers = queue.SimpleQueue[tuple[int, dict[str, Any], Any]]
#: How a request begins as a phase of its run (``Run._begin_cell``: id, cell, ranks; None: no run).
Begin = Callable[[int, Optional[int], list[int]], Optional[CellPhase]]
#: How a request goes to ranks (``Run._tell``): (ranks, what routes it, the rest pickled, give up) →
#: the ranks it did not reach.
Tell = Callable[[list[int], dict[str, Any], Optional[bytes], Optional[Callable[[], bool]]], list[int]]


class RankGone(Exception):
    """A rank ended, or the session's run did, while the request was in flight."""


def answer_of(event: dict[str, Any], attachment: Any) -> dict[str, Any]:
    """A rank's answer whole again: what routed it, and its pickled rest (a ``Received``)."""
    return pickling.joined(event, attachment.data if attachment is not None else None, SESSION_ROUTED)


class _Presses:
    def __init__(self) -> None:
        self.count = 0


@contextlib.contextmanager
def interrupts_counted() -> Iterator[_Presses]:
    """While inside, SIGINT (Kernel → Interrupt, Ctrl-C) counts in the yielded object instead of
    raising ``KeyboardInterrupt`` at whatever line runs (a reply half read, a frame half sent).
    Once a press was counted, the next are held (``hold_presses``). Off the main thread, or where
    SIGINT is not Python's to handle, nothing changes."""
    presses = _Presses()
    if not _ours_to_handle():
        yield presses
        return

    def count(signum: int, frame: Any) -> None:
        presses.count += 1

    previous = signal.signal(signal.SIGINT, count)
    try:
        yield presses
    finally:
        signal.signal(signal.SIGINT, previous)
        if presses.count:
            hold_presses()


def hold_presses() -> None:
    """Drop SIGINT for ``PRESS_HELD`` seconds, then handle it as before: the second press of a
    double press would land while the first's interrupt is raised or shown (IPython then prints
    "KeyboardInterrupt" in place of the cell's message). The kernel puts its own handler back once
    the cell ends."""
    if not _ours_to_handle():
        return
    previous = signal.getsignal(signal.SIGINT)
    original = getattr(previous, "held_from", previous)
    until = time.monotonic() + PRESS_HELD

    def held(signum: int, frame: Any) -> None:
        if time.monotonic() >= until:
            signal.signal(signal.SIGINT, original)
            # Sent again once this handler has returned, so that it lands in the code it interrupts.
            again = threading.Timer(0.01, signal.pthread_kill, (threading.main_thread().ident, signal.SIGINT))
            again.daemon = True
            again.start()

    held.held_from = original  # type: ignore[attr-defined]
    signal.signal(signal.SIGINT, held)


@contextlib.contextmanager
def interrupts_said(stage: threading.local, before: str, after: str, ranks: list[int]) -> Iterator[None]:
    """Kernel → Interrupt in the notebook's own part of a request (``stage.now``: "before", while
    it is prepared; "after", while what the ranks sent back is loaded; None: the exchange counts
    presses, and what follows it says its own) raised as one line that says what became of the
    request (``SessionInterrupted``), not as this package's frames; a quick second press is held."""
    stage.now = "before"
    try:
        yield
    except KeyboardInterrupt as e:
        now = getattr(stage, "now", None)
        if isinstance(e, SessionInterrupted) or now is None:
            raise
        hold_presses()
        if now == "before":
            raise SessionInterrupted(f"{before.capitalize()} was interrupted before it was sent: nothing reached the "
                                     "ranks; the session goes on (its namespaces are as they were)") from None
        raise SessionInterrupted(f"{after.capitalize()} was interrupted in the notebook once {ranks_text(ranks)} had "
                                 "answered: what came back is dropped; the session goes on (its namespaces are kept)"
                                 ) from None
    finally:
        stage.now = None


def _ours_to_handle() -> bool:
    """Whether SIGINT reaches this thread as a Python handler (the main thread's)."""
    return threading.current_thread() is threading.main_thread() and callable(signal.getsignal(signal.SIGINT))


def hellos(answers: Answers, world: int, ended: Callable[[], bool]) -> bool:
    """Wait until every rank of a session just formed says hello (True), or the run ended first."""
    said: set[int] = set()
    while len(said) < world:
        if ended():
            return False
        try:
            rank, event, _ = answers.get(timeout=_POLL)
        except queue.Empty:
            continue
        if event.get("op") == "hello":
            said.add(rank)
    return True


class CellOutput:
    """What the ranks print during one request, shown as it comes: each line named by its rank
    (``[rank 1] ...``), written in batches (one write per stream per ``flush``) and bounded
    (``SHOWN_LINES`` lines, ``SHOWN_CHARS`` characters, ``SHOWN_DISPLAYS`` displays, for all
    ranks together, each of the request's ``ranks`` its share of the lines, so that a rank whose
    output comes first does not hide the others'; each line cut at ``LINE_CHARS``).

    A line without its end yet (``end=''``, a progress bar) is shown at the next flush and goes
    on where it stopped; the pieces a rank's ``print`` writes in one go stay on one line. A
    carriage return (tqdm's bars) redraws the line, its rank named again, and only the last
    redraw of a flush is written. Another rank's text on the same stream starts a line of its own;
    a line so ended and redrawn (each rank's bar) goes on on a new line, at most every
    ``REDRAW_EVERY`` seconds and at its end, and such lines do not count against the rank's lines.

    >>> shown = []
    >>> out = CellOutput(lambda stream, text: shown.append(text), lines=2)
    >>> out.add(1, "stdout", "a\\nb\\nc\\nd")
    >>> out.flush(); out.close(); print("".join(shown), end="")
    [rank 1] a
    [rank 1] b
    [rank 1] 2 more lines not shown (session.current_run.output(1) has them)
    """

    def __init__(self, write: Optional[Callable[[str, str], None]] = None, lines: int = SHOWN_LINES,
                 chars: int = SHOWN_CHARS, display: Optional[Callable[..., None]] = None, ranks: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._write = write or _write_std
        self._clock = clock
        self._display = display or _display_raw
        self._lines_each = max(lines // max(ranks, 1), 1)
        self._lines_left: dict[int, int] = {}  # rank → lines it may still show
        self._chars_left = chars
        self._open: dict[str, Optional[int]] = {"stdout": None, "stderr": None}  # the rank whose line is open
        self._column: dict[tuple[int, str], int] = {}  # characters of the open line shown
        self._skipping: set[tuple[int, str]] = set()  # a line shown cut: the rest of it is not shown
        self._ended_by_other: set[tuple[int, str]] = set()  # a line shown and ended by another rank's
        self._redrawn_at: dict[tuple[int, str], float] = {}  # when such a line was last drawn anew
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

    def _show_partial(self, rank: int, stream: str, force: bool = False) -> None:
        """Show what ``rank``'s line holds and was not shown yet (the line stays open); a redraw of
        a line another rank's ended waits for its turn (``REDRAW_EVERY``) unless ``force``."""
        key = (rank, stream)
        text, redraw = self._partial.get(key, ("", False))
        if not text and not redraw:
            return
        if redraw and not force and key in self._ended_by_other and len(text) <= LINE_CHARS and \
                self._clock() - self._redrawn_at.get(key, float("-inf")) < REDRAW_EVERY:
            return  # (held: the next redraw replaces it; one longer than a line is shown, cut, at once)
        del self._partial[key]
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
        if redraw and key in self._ended_by_other:  # drawn again below another rank's line: not a line of its own
            self._redrawn_at[key] = self._clock()
            return self._start(rank, stream, counted=False)
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

    def _start(self, rank: int, stream: str, counted: bool = True) -> bool:
        """Open a line of ``rank`` on ``stream`` (ending another rank's first); False when the
        request's bounds are spent: the line is counted, not shown. ``counted``: it takes one of
        the rank's lines (a line drawn again does not)."""
        left = self._lines_left.setdefault(rank, self._lines_each)
        if (counted and left <= 0) or self._chars_left <= 0:
            self._hidden[rank] = self._hidden.get(rank, 0) + 1
            self._end_open(stream)
            return False
        self._end_open(stream)
        self._lines_left[rank] = left - 1 if counted else left
        self._open[stream] = rank
        self._column[(rank, stream)] = 0
        self._skipping.discard((rank, stream))
        self._put(stream, f"[rank {rank}] ")
        return True

    def _complete(self, rank: int, stream: str) -> None:
        """``rank``'s line ended: show what it held, then its end."""
        key = (rank, stream)
        text, redraw = self._partial.pop(key, ("", False))
        if not text and key in self._ended_by_other and self._open[stream] != rank:
            self._ended_by_other.discard(key)  # its end was written when another rank's line began
            return
        if self._begin(rank, stream, redraw):
            self._text(rank, stream, text)
        if self._open[stream] == rank:
            self._put(stream, "\n")
            self._open[stream] = None
        self._skipping.discard(key)
        self._column.pop(key, None)
        self._ended_by_other.discard(key)

    def _put(self, stream: str, text: str) -> None:
        self._chars_left -= len(text)
        self._ready[stream].append(text)

    def _end_open(self, stream: str) -> None:
        rank = self._open[stream]
        if rank is not None:
            self._ended_by_other.add((rank, stream))
            self._put(stream, "\n")
            self._open[stream] = None
            self._column.pop((rank, stream), None)
            self._skipping.discard((rank, stream))

    def flush(self, force: bool = False) -> None:
        """Write what was taken so far, lines without their end included (a redraw waiting for its
        turn too with ``force``): one write per stream."""
        for rank, stream in list(self._partial):
            self._show_partial(rank, stream, force)
        for stream, pieces in self._ready.items():
            if pieces:
                text = "".join(pieces)
                pieces.clear()  # (before the write: one that fails loses it rather than write it twice)
                self._write(stream, text)

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
        self.flush(force=True)
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


class BetweenCells:
    """What the ranks print while no request is in flight (a thread a cell started, printing after
    the cell ended), shown at once in the cell of the last request (``follow``), each line named
    by its rank and bounded as a request's output is, until the next request.

    The run's supervising thread only hands the text over (``add`` never waits on the notebook's
    streams: past ``HELD`` texts waiting, the rest is dropped and said); a thread of its own
    writes it, started by the first text and ended after ``IDLE`` seconds without any, or by
    ``close``. A write that fails (a closed or broken stream) is logged and its text dropped."""

    HELD = 1000
    IDLE = 5.0

    def __init__(self) -> None:
        self.ranks = 1  # the session's: each its share of the lines (set once its run has them)
        self._warned = False
        self._texts: queue.Queue[Optional[tuple[int, str, str]]] = queue.Queue(self.HELD)
        self._context = contextvars.copy_context()
        self._output = CellOutput()
        self._next: Optional[contextvars.Context] = None  # the context of a request begun since
        self._dropped = 0
        self._flushed = 0.0
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()  # the thread, started and ended

    def follow(self, context: contextvars.Context) -> None:
        """A request begins in ``context`` (its cell's): what comes after it shows there."""
        self._next = context

    def add(self, rank: int, stream: str, text: str) -> None:
        """Show what ``rank`` printed on ``stream`` outside any request."""
        try:
            self._texts.put_nowait((rank, stream, text))
        except queue.Full:
            with self._lock:  # (the writer's thread reads and resets the count)
                self._dropped += 1
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="ddp-session-output", daemon=True)
                self._thread.start()

    def close(self, timeout: float = 2.0) -> None:
        """End the lines left open and say what was not shown; the thread ends."""
        with self._lock:
            thread = self._thread
        if thread is not None:
            try:
                self._texts.put(None, timeout=timeout)
            except queue.Full:
                return
            thread.join(timeout)

    def _write(self) -> None:
        while True:
            try:
                item = self._texts.get(timeout=self.IDLE)
            except queue.Empty:
                with self._lock:
                    if self._texts.empty():  # (an add() seen after this starts another)
                        self._thread = None
                        return
                continue
            context = self._next
            if context is not None:  # a request began: what came before it is ended where it showed
                self._next = None
                self._safely(self._output.close)
                self._context, self._output = context, CellOutput(ranks=self.ranks)
            if item is None:
                self._safely(self._output.close)
                with self._lock:
                    self._thread = None
                return
            self._output.add(*item)
            if self._texts.empty() or time.monotonic() - self._flushed >= _POLL:  # (a flood: still a few a second)
                self._flushed = time.monotonic()
                self._safely(self._output.flush, True)
                with self._lock:
                    dropped, self._dropped = self._dropped, 0
                if dropped:
                    self._safely(_write_std, "stderr", f"[ranks] {dropped} more pieces of output not shown "
                                                       "(session.current_run.output(rank) has them)\n")

    def _safely(self, write: Callable[..., None], *args: Any) -> None:
        try:
            self._context.run(write, *args)
        except Exception:  # a stream that cannot be written (closed, broken): the run's output has the text
            if not self._warned:
                self._warned = True
                log.warning("a session's rank output could not be shown", exc_info=True)


class ValueNotSent:
    """A rank's value that could not come to the notebook (a generator cannot be pickled; a
    DDP-wrapped model cannot be loaded outside its process group): in its place, its text as
    the rank computed it (its ``repr``, which this object's is), and why it stayed there.

    ``session.pull(name)`` raises for such a value; the rank's namespace still holds it.
    """

    def __init__(self, rank: int, text: str, reason: str, error: str = "", why: str = "") -> None:
        self.rank = rank
        self.text = text
        self.reason = reason
        self.error = error  # the type of the exception that kept it there
        self.why = why or reason  # the reason without naming the rank: the same on every rank

    def __repr__(self) -> str:
        return self.text


def loaded_value(rank: int, reply: dict[str, Any]) -> Any:
    """The value a rank's reply carries, loaded here; a :class:`ValueNotSent` when it could not
    be pickled there or loaded here; None when it carries none."""
    text = str(reply.get("text", ""))
    if "unsent" in reply:
        unsent = str(reply["unsent"])
        return ValueNotSent(rank, text, f"it cannot be pickled on rank {rank}: {unsent}", unsent.partition(":")[0],
                            why=f"cannot be pickled: {unsent}")
    data = reply.get("value")
    if not isinstance(data, bytes):
        return None
    try:
        return pickling.loads(data)
    except Exception as exc:  # noqa: BLE001 - unpickling runs the value's own code: any error
        why = f"cannot be loaded in the notebook: {type(exc).__name__}: {str(exc) or repr(exc)}"
        return ValueNotSent(rank, text, f"it {why}", type(exc).__name__, why=why)


def unsent_error(name: str, value: ValueNotSent) -> dict[str, Any]:
    """The error reply ``pull(name)`` makes of a value that could not come: pull is for objects.
    Said the same way for every rank (its own text aside), so that it is said once."""
    return {"op": "error", "error": {
        "kind": "error", "phase": "run", "exc_type": "ValueNotSent", "time": 0.0,
        "message": f"{name!r} {value.why}; it stays in the ranks' namespaces, where cells can use it"}}


class Exchange:
    """Send one request to ``ranks`` and gather their replies (``run()``): the run's supervisor
    judges it as a phase of the run (``begin``: ``Run._begin_cell``); this shows what the ranks
    send as it comes, keeps their replies, and hands the user's interrupts on. ``record`` is
    the session's record (what its view reads)."""

    def __init__(self, tell: Tell, answers: Answers, begin: Begin, ranks: list[int], message: dict[str, Any],
                 cell: Optional[int], record: Any, output: Optional[CellOutput] = None) -> None:
        self.tell, self.answers, self.begin = tell, answers, begin
        self.ranks, self.message, self.cell, self.record = ranks, message, cell, record
        self.output = output or CellOutput()
        self.outcome = Gathered()
        self.phase: Optional[CellPhase] = None

    def run(self) -> Gathered:
        """Send the request and wait until it is judged.

        Raises
        ------
        RankGone
            A rank ended, or the run did, meanwhile.
        """
        with interrupts_counted() as presses:
            try:
                self.phase = self.begin(self.message["id"], self.cell, self.ranks)
                if self.phase is None or self.phase.outcome.gone:
                    raise RankGone
                self.outcome = outcome = self.phase.outcome
                self._send(presses)
                if outcome.abandoned:
                    return outcome
                handled, stopping, flushed = 0, False, 0.0
                while not outcome.ended.is_set():
                    self._pump()
                    if time.monotonic() - flushed >= _POLL:  # one write per stream per look, however much came
                        self.output.flush()
                        flushed = time.monotonic()
                    pressed, handled = presses.count > handled, presses.count
                    if pressed or (self.record.interrupt_asked() and not stopping):
                        stopping = True
                        self._asked_to_stop(presses.count)
                self._pump(timeout=0.0)  # what came before the verdict
                outcome.interrupted = outcome.interrupted or presses.count > 0  # (pressed as it ended)
                if outcome.gone:
                    raise RankGone
            finally:
                self.output.close()
        return outcome

    def _asked_to_stop(self, presses: int) -> None:
        """The user asked to interrupt: the first time, the ranks still in the cell are asked to
        leave it; asked again (thrice for a push or a pull, which the ranks cannot leave midway),
        the request is given up on."""
        assert self.phase is not None  # (begun before anything is sent)
        phase_asked = self.outcome.interrupted
        self.outcome.interrupted = True
        if self.cell is None:
            if presses >= 3:
                self.phase.abandon()
            return
        if not phase_asked:
            self.phase.interrupt()
        elif presses >= 2:
            self.phase.abandon()


    def _send(self, presses: _Presses) -> None:
        """Send the request to each rank whole. A third press while it is on its way gives it up
        (a frame cut midway: the ranks cannot go on); the presses before, and those while it was
        sent whole, are the loop's to act on once it has arrived (a double press loses nothing)."""
        header, body = pickling.split(self.message, SESSION_ROUTED)
        missed = self.tell(self.ranks, header, body, lambda: presses.count >= 3 or self.outcome.ended.is_set())
        if missed and presses.count >= 3:
            assert self.phase is not None  # (begun before anything is sent)
            self.outcome.abandoned = self.outcome.interrupted = True
            self.phase.abandon()
        elif missed:
            raise RankGone

    def _pump(self, timeout: float = _POLL) -> None:
        """Wait up to ``timeout`` for what the ranks send and take each answer; a rank's end
        raises ``RankGone``."""
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
            if event.get("kind") == EventKind.OUTPUT:  # this request's, or a thread's outside any cell (not a cut
                if event.get("cell") in (self.cell, None):  # request's late lines: the run has them)
                    self.output.add(rank, str(event.get("stream")), str(event.get("text")))
                continue
            self._take(rank, answer_of(event, attachment))

    def _take(self, rank: int, reply: dict[str, Any]) -> None:
        reply = escape_surrogates(reply)  # an error's text, a display: shown in the notebook
        op = reply.get("op")
        if op == "display" and reply.get("cell") == self.cell and self.cell is not None:
            data, metadata = reply.get("data"), reply.get("metadata")
            if isinstance(data, dict) and data:
                self.output.display(rank, data, metadata if isinstance(metadata, dict) else {})
        elif op in ("done", "error") and reply.get("id") == self.message["id"]:
            self.outcome.replies[rank] = reply


def answered(answers: Answers, between: BetweenCells, exchanging: threading.Event, rank: int, event: dict[str, Any],
             attachment: Any) -> None:
    """What a session's rank sent the session (on the run's supervising thread): to the request in
    flight, which shows its output; what a rank prints while none is, to ``between``."""
    if event.get("kind") == EventKind.OUTPUT and event.get("cell") is None and not exchanging.is_set():
        between.add(rank, str(event.get("stream")), str(event.get("text", "")))
    else:
        answers.put((rank, event, attachment))


def on_run_event(answers: Answers, event: dict[str, Any]) -> None:
    """An event of a session's run: a rank's end goes to the request in flight (it is over)."""
    if event.get("kind") == EventKind.EXITED:
        answers.put((event.get("rank", -1), {"op": "exited"}, None))
