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
from typing import Any

import cloudpickle

__all__ = ["dumps", "loads", "Pickler", "PROTOCOL"]

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
