"""Errors of this package drawn by IPython's own traceback formatter (its colours, ``Cell In[3]``
names, source lines), given only the user's frames: ``core.tracebacks`` chooses the frames,
this draws them. Set once, on import of the package (``register``)."""
from __future__ import annotations

from types import TracebackType
from typing import Any, Optional

from ..core.errors import draw_tracebacks_with
from ..core.tracebacks import name_cells_with

__all__ = ["register"]


def _shell() -> Any:
    try:
        from IPython import get_ipython
    except ImportError:
        return None
    return get_ipython()


def _draw(error: BaseException, frames: Optional[TracebackType]) -> list[str]:
    shell = _shell()
    formatter = getattr(shell, "InteractiveTB", None)
    if formatter is None:  # not in an IPython shell: as Python prints it
        import traceback

        return "".join(traceback.format_exception(type(error), error, frames)).rstrip("\n").split("\n")
    lines: list[str] = formatter.structured_traceback(type(error), error, frames, tb_offset=0)
    return lines


def _cell_name(path: str) -> Optional[str]:
    """``In[3]`` for the file IPython compiled cell 3 from; None for any other file."""
    compiler = getattr(_shell(), "compile", None)
    named = compiler.format_code_name(path) if compiler is not None else None
    return str(named[1]) if named else None


def register() -> None:
    """Draw this package's errors with IPython's formatter wherever one runs, and name notebook
    cells in stacks as IPython does (``In[3]``)."""
    draw_tracebacks_with(_draw)
    name_cells_with(_cell_name)
