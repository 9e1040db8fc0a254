"""The event wire format between workers and the supervisor, and the on-disk event log.

An event is a JSON object with at least ``kind`` and ``time`` (``time.time()`` of the
sender). On a pipe each event is one frame: a 4-byte big-endian length, then the JSON.
An event may carry a binary attachment (a pickled return value): its ``blob`` field gives
the attachment's size and the raw bytes follow as the next frame. On disk, the run's
``events.jsonl`` holds one event per line (attachments are not written there).

Pure Python; no torch, no IPython.
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Optional

__all__ = ["encode", "FrameDecoder", "to_json_value", "EVENT_KINDS"]

_LEN = struct.Struct(">I")

# Worker → supervisor: started, ready, progress, result, done, error.
# Supervisor → log: run_started, output, exited, failure, stopping, stalled, run_finished.
EVENT_KINDS = (
    "run_started", "started", "ready", "progress", "output", "result", "done", "error",
    "exited", "failure", "stopping", "stalled", "run_finished",
)


def encode(event: dict, blob: Optional[bytes] = None) -> bytes:
    """Frame an event (and its attachment) for a pipe."""
    if blob is not None:
        event = dict(event, blob=len(blob))
    data = json.dumps(event, separators=(",", ":"), allow_nan=False, default=str).encode()
    out = _LEN.pack(len(data)) + data
    if blob is not None:
        out += _LEN.pack(len(blob)) + blob
    return out


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, take complete events out.

    >>> d = FrameDecoder()
    >>> d.feed(encode({"kind": "done", "time": 1.0}) + encode({"kind": "result"}, b"xy"))
    [({'kind': 'done', 'time': 1.0}, None), ({'kind': 'result', 'blob': 2}, b'xy')]
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: Optional[dict] = None  # an event waiting for its attachment

    def feed(self, data: bytes) -> list[tuple[dict, Optional[bytes]]]:
        self._buf += data
        out: list[tuple[dict, Optional[bytes]]] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < _LEN.size + n:
                break
            payload = bytes(self._buf[_LEN.size:_LEN.size + n])
            del self._buf[:_LEN.size + n]
            if self._pending is not None:
                out.append((self._pending, payload))
                self._pending = None
                continue
            event = json.loads(payload)
            if "blob" in event:
                self._pending = event
            else:
                out.append((event, None))
        return out

    @property
    def incomplete(self) -> bool:
        """True when bytes of an unfinished frame are buffered (the sender died mid-write)."""
        return bool(self._buf) or self._pending is not None


def to_json_value(value: Any, name: str = "value") -> Any:
    """A metric value as JSON: numbers, strings, bools; tensors and numpy scalars via .item().

    NaN and infinities become None-safe strings ("nan", "inf") so the log stays valid JSON.
    """
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError) as e:
            raise TypeError(f"metric {name!r} must be a number or a one-element tensor: {e}") from None
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    raise TypeError(f"metric {name!r} must be a number or a string, not {type(value).__name__}")


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (pipes may accept partial writes)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
