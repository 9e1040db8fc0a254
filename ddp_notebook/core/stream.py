"""A run's event stream: events kept in order, folded into a ``RunState``, appended to the run's
log on disk and handed to subscribers (the panel, ``wait_for`` helpers, your own code).

Memory and disk are bounded (``core.bounds``): every lifecycle event is kept, but only the most
recent progress and output events (``TAIL_EVENTS``, ``TAIL_BYTES``; ``dropped`` counts the
others, which the log on disk still has), and the log stops taking progress and output at
``LOG_BYTES``, with a ``log_truncated`` event that says so.

>>> stream = EventStream()
>>> seen = []
>>> stream.subscribe(lambda event: seen.append(event["kind"]))
>>> stream.emit({"kind": "run_started", "time": 0.0, "run_id": "r1", "devices": ["cpu:0"]})
>>> stream.state.run_id, seen
('r1', ['run_started'])
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from typing import IO, Any, Optional

from . import bounds
from .events import EventKind
from .state import RunState

__all__ = ["EventStream", "Subscriber", "BULK_KINDS"]

# The kinds of events a run sends without end; the others are a handful per rank.
BULK_KINDS = frozenset({EventKind.PROGRESS, EventKind.OUTPUT})

log = logging.getLogger(__name__)

Subscriber = Callable[[dict[str, Any]], None]


class EventStream:
    """Thread-safe: events may be emitted from a supervisor thread while front ends read."""

    def __init__(self, log_file: Optional[IO[str]] = None) -> None:
        self.events: list[dict[str, Any]] = []
        self.state = RunState()
        self._log = log_file
        self._lock = threading.RLock()
        self._subscribers: list[Subscriber] = []
        self.dropped = 0  # progress and output events no longer in memory (the log has them)
        self._bulk_count = self._bulk_bytes = 0
        self._log_bytes = 0
        self._log_full = False

    @classmethod
    def replay(cls, events: Iterable[dict[str, Any]]) -> EventStream:
        """A stream holding ``events`` (read back from a log), with nothing written anywhere."""
        stream = cls()
        for event in events:
            stream.emit(event)
        stream.close()  # as much as of any ended run
        return stream

    @property
    def done(self) -> bool:
        """True once the stream holds the run's end."""
        return self.state.finished

    def emit(self, event: dict[str, Any]) -> None:
        """Keep ``event``, fold it into the state, log it, then tell every subscriber; a lone
        surrogate in its strings escaped first (``bounds.escape_surrogates``): every view shows
        what this holds."""
        event = bounds.escape_surrogates(event)
        with self._lock:
            self.events.append(event)
            self.state.apply(event)
            bulk = event.get("kind") in BULK_KINDS
            if bulk:
                self._bulk_count += 1
                self._bulk_bytes += bounds.event_weight(event)
                if self._bulk_count > bounds.TAIL_EVENTS or self._bulk_bytes > bounds.TAIL_BYTES:
                    self._drop_oldest_bulk(bounds.TAIL_EVENTS // 2, bounds.TAIL_BYTES // 2)
            full = not self._write(event, bulk)
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:  # a front end's bug must not stop supervision; it is logged, not lost
                log.exception("a subscriber of run %s failed on a %r event", self.state.run_id, event.get("kind"))
        if full:  # said once, in the log and the state
            self.emit({"kind": EventKind.LOG_TRUNCATED, "time": event.get("time"), "limit_bytes": bounds.LOG_BYTES})

    def emit_late(self, event: dict[str, Any], append: Callable[[str], None]) -> None:
        """Keep and fold ``event``, which comes after the run ended (a session's cell that the
        run's end cut short), and when the log is closed already, add its line with ``append``
        (the run's directory appends to the log file)."""
        with self._lock:
            closed = self._log is None or self._log.closed
        self.emit(event)
        if closed and self._log is not None:  # (a stream read back from disk has no log to add to)
            append(json.dumps(event, default=str) + "\n")

    def _write(self, event: dict[str, Any], bulk: bool) -> bool:
        """Append ``event`` to the log; False for the first progress or output the log has no
        room for (lifecycle events are always written)."""
        if self._log is None or self._log.closed or (bulk and self._log_full):
            return True
        line = json.dumps(event, default=str) + "\n"
        if bulk and self._log_bytes + len(line) > bounds.LOG_BYTES:
            self._log_full = True
            return False
        self._log.write(line)
        self._log_bytes += len(line)
        return True

    def _drop_oldest_bulk(self, keep_count: int, keep_bytes: int) -> None:
        """Keep the newest ``keep_count`` progress and output events, up to ``keep_bytes`` (while
        a run goes on, half its budget: one pass per half-budget of new events); the state
        already folded in what is dropped."""
        kept: list[dict[str, Any]] = []
        count = size = 0
        for event in reversed(self.events):
            if event.get("kind") in BULK_KINDS:
                weight = bounds.event_weight(event)
                if count >= keep_count or size + weight > keep_bytes:
                    self.dropped += 1
                    continue
                count, size = count + 1, size + weight
            kept.append(event)
        kept.reverse()
        self.events[:] = kept
        self._bulk_count, self._bulk_bytes = count, size

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(event)`` for each future event (from the thread that emits it)."""
        with self._lock:
            self._subscribers.append(callback)

    def select(self, predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """The events so far for which ``predicate`` holds (a consistent snapshot)."""
        with self._lock:
            return [e for e in self.events if predicate(e)]

    def close(self) -> None:
        """Close the log (the run has ended; later events are still kept and folded) and keep
        less of its progress and output in memory (``bounds.ENDED_TAIL_*``)."""
        with self._lock:
            if self._log is not None:
                self._log.close()
            if self._bulk_count > bounds.ENDED_TAIL_EVENTS or self._bulk_bytes > bounds.ENDED_TAIL_BYTES:
                self._drop_oldest_bulk(bounds.ENDED_TAIL_EVENTS, bounds.ENDED_TAIL_BYTES)
