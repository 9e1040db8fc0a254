"""cloudpickle, keeping the file names of functions sent by value.

cloudpickle (3.x) replaces a code object's ``co_filename`` with ``"<dynamic-code>"`` to make
payloads deterministic; tracebacks from the workers would then not say which cell or file a
frame is in. Code objects are pickled here with ``marshal`` instead (the format of ``.pyc``
files, which keeps every field, the file name included), through the pickler's public
``dispatch_table``; cloudpickle still handles the functions around them (globals, closures,
defaults), and the cells' sources are shipped beside the call (see ``lifecycle.call``).

Like cloudpickle's own, a pickled code object loads only in the same Python version: ranks run
the notebook's interpreter (engines on other hosts must run the same Python).

>>> def where(): pass
>>> loads(dumps(where)).__code__.co_filename == where.__code__.co_filename
True
"""
from __future__ import annotations

import io
import marshal
import types
from collections import ChainMap
from collections.abc import Sequence
from typing import Any, Optional

import cloudpickle

__all__ = ["dumps", "loads", "Pickler", "PROTOCOL", "split", "joined"]

loads = cloudpickle.loads
PROTOCOL = cloudpickle.DEFAULT_PROTOCOL


def _reduce_code(code: types.CodeType) -> tuple[Any, tuple[bytes]]:
    return marshal.loads, (marshal.dumps(code),)


class Pickler(cloudpickle.Pickler):
    """cloudpickle's Pickler, with code objects pickled whole (their real file names kept)."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)


def dumps(obj: Any) -> bytes:
    """``cloudpickle.dumps`` with real file names in code objects."""
    buf = io.BytesIO()
    Pickler(buf, protocol=PROTOCOL).dump(obj)
    return buf.getvalue()


def split(message: dict[str, Any], routed: Sequence[str]) -> tuple[dict[str, Any], Optional[bytes]]:
    """``message`` as a frame of ``core.events`` carries it: the keys ``routed`` in the frame's
    JSON, the rest pickled as its attachment (None: no rest). ``joined`` is its inverse.

    >>> split({"op": "run", "code": "x"}, ("op",))[0]
    {'op': 'run'}
    >>> joined(*split({"op": "run", "code": "x"}, ("op",)), ("op",))
    {'op': 'run', 'code': 'x'}
    """
    rest = {k: v for k, v in message.items() if k not in routed}
    return {k: message[k] for k in routed if k in message}, (dumps(rest) if rest else None)


def joined(header: dict[str, Any], body: Optional[bytes], routed: Sequence[str]) -> dict[str, Any]:
    """A message whole again from a frame's JSON (its keys ``routed``) and attachment."""
    message = {k: header[k] for k in routed if k in header}
    if body:
        message.update(loads(body))
    return message
