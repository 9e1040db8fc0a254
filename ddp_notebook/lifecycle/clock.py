"""Where the supervision core reads time: ``monotonic`` for deadlines, ``time`` for the timestamps
of events, ``sleep`` to wait. The real clock by default; tests pass a fake one, so that every
ordering of failures, windows and deadlines is played deterministically.
"""
from __future__ import annotations

import time as _time
from typing import Protocol

__all__ = ["Clock", "REAL_CLOCK"]


class Clock(Protocol):
    """A source of time (``REAL_CLOCK``, or a test's)."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (for deadlines)."""

    def time(self) -> float:
        """Seconds since the epoch (for events' timestamps)."""

    def sleep(self, seconds: float) -> None:
        """Let ``seconds`` pass."""


class _RealClock:
    monotonic = staticmethod(_time.monotonic)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)


REAL_CLOCK: Clock = _RealClock()
