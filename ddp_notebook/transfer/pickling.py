"""cloudpickle, keeping the file names of functions sent by value.

cloudpickle (3.x) replaces ``co_filename`` with ``"<dynamic-code>"`` to make payloads
deterministic; tracebacks from the workers would then not say which cell or file a frame is
in. We keep the real name (and ship the cells' sources, see ``lifecycle.call``).
"""
from __future__ import annotations

import copyreg
import io
import types
from collections import ChainMap
from typing import Any

import cloudpickle

__all__ = ["dumps", "loads", "Pickler", "PROTOCOL"]

loads = cloudpickle.loads

try:
    _code_reduce = cloudpickle.cloudpickle._code_reduce
except AttributeError:  # pragma: no cover - another cloudpickle: fall back to its own names
    _code_reduce = None


def _code_reduce_keeping_filename(code: types.CodeType) -> Any:
    ctor, args = _code_reduce(code)
    args = list(args)
    if "<dynamic-code>" in args:
        args[args.index("<dynamic-code>")] = code.co_filename
    return ctor, tuple(args)


PROTOCOL = cloudpickle.DEFAULT_PROTOCOL


class Pickler(cloudpickle.Pickler):
    """cloudpickle's Pickler, keeping the real file names of code objects."""

    if _code_reduce is not None:
        _dispatch_table = dict(cloudpickle.Pickler._dispatch_table)
        _dispatch_table[types.CodeType] = _code_reduce_keeping_filename
        dispatch_table = ChainMap(_dispatch_table, copyreg.dispatch_table)


def dumps(obj: Any) -> bytes:
    """cloudpickle.dumps with real file names in code objects."""
    buf = io.BytesIO()
    Pickler(buf, protocol=PROTOCOL).dump(obj)
    return buf.getvalue()
