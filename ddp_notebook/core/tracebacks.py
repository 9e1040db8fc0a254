"""Tracebacks that show the user's frames: the frames of this package (and of the shell that ran
a cell) are left out, so an error reads as the user's call and the message, not as the
library's inner workings. ``$DDP_NOTEBOOK_TRACEBACKS=full`` keeps every frame (for bug reports).

>>> def users_code():
...     raise ValueError("bad value")
>>> try:
...     users_code()
... except ValueError as e:
...     print(format_user_traceback(e).splitlines()[-1])
ValueError: bad value
"""
from __future__ import annotations

import os
import traceback
from types import TracebackType
from typing import Optional

__all__ = ["FULL_ENV", "is_library_file", "user_frames", "format_user_traceback", "show_full"]

FULL_ENV = "DDP_NOTEBOOK_TRACEBACKS"
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The frames above a cell's own code in an IPython shell (``run_code``'s exec): IPython's own files.
_SHELL = os.sep + os.path.join("IPython", "core") + os.sep


def show_full() -> bool:
    """Whether every frame is kept (``$DDP_NOTEBOOK_TRACEBACKS=full``)."""
    return os.environ.get(FULL_ENV, "").strip().lower() == "full"


def is_library_file(path: str) -> bool:
    """True for a file of this package, or of the IPython shell that runs cells."""
    return path.startswith(_PACKAGE) or _SHELL in path


def user_frames(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """``tb`` without the frames of library files (a new chain; ``tb`` is left as it is): None
    when no frame is the user's; ``tb`` itself when ``show_full()``."""
    if show_full():
        return tb
    kept = []
    while tb is not None:
        if not is_library_file(tb.tb_frame.f_code.co_filename):
            kept.append(tb)
        tb = tb.tb_next
    chain: Optional[TracebackType] = None
    for t in reversed(kept):
        chain = TracebackType(chain, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return chain


def format_user_traceback(exc: BaseException) -> str:
    """``exc`` formatted as Python prints it, each exception of its chain without the frames of
    library files (an exception raised with no user frame on its stack shows its message only)."""
    te = traceback.TracebackException.from_exception(exc)
    if not show_full():
        seen: set[int] = set()
        todo = [te]
        while todo:
            t = todo.pop()
            if id(t) in seen:
                continue
            seen.add(id(t))
            t.stack = traceback.StackSummary.from_list([f for f in t.stack if not is_library_file(f.filename)])
            todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format())
