"""A run's event stream: every event kept in order, folded into a ``RunState``, appended to the
run's log on disk and handed to subscribers (the panel, ``wait_for`` helpers, your own code).

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

from .state import RunState

__all__ = ["EventStream", "Subscriber"]

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

    @classmethod
    def replay(cls, events: Iterable[dict[str, Any]]) -> EventStream:
        """A stream holding ``events`` (read back from a log), with nothing written anywhere."""
        stream = cls()
        for event in events:
            stream.emit(event)
        return stream

    @property
    def done(self) -> bool:
        """True once the stream holds the run's end."""
        return self.state.finished

    def emit(self, event: dict[str, Any]) -> None:
        """Keep ``event``, fold it into the state, log it, then tell every subscriber."""
        with self._lock:
            self.events.append(event)
            self.state.apply(event)
            if self._log is not None and not self._log.closed:
                self._log.write(json.dumps(event, default=str) + "\n")
            subscribers = list(self._subscribers)
        for callback in subscribers:
            try:
                callback(event)
            except Exception:  # a front end's bug must not stop supervision; it is logged, not lost
                log.exception("a subscriber of run %s failed on a %r event", self.state.run_id, event.get("kind"))

    def subscribe(self, callback: Subscriber) -> None:
        """Call ``callback(event)`` for each future event (from the thread that emits it)."""
        with self._lock:
            self._subscribers.append(callback)

    def select(self, predicate: Callable[[dict[str, Any]], bool]) -> list[dict[str, Any]]:
        """The events so far for which ``predicate`` holds (a consistent snapshot)."""
        with self._lock:
            return [e for e in self.events if predicate(e)]

    def close(self) -> None:
        """Close the log; later events are still kept and folded."""
        with self._lock:
            if self._log is not None:
                self._log.close()
