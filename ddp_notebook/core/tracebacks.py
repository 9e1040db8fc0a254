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

import functools
import os
import re
import site
import sysconfig
import traceback
from collections.abc import Callable
from types import TracebackType
from typing import Optional

__all__ = ["FULL_ENV", "is_library_file", "is_installed_file", "installed_dirs", "user_frames", "format_user_traceback",
           "show_full", "name_cells_with", "file_name", "name_cells_in"]

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


@functools.lru_cache(maxsize=1)
def installed_dirs() -> tuple[str, ...]:
    """Where installed code lives, each as written and resolved: the standard library and the
    site-packages folders (the user's own code is elsewhere, an editable install's included)."""
    paths = sysconfig.get_paths()
    dirs = {paths.get(key, "") for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs |= set(getattr(site, "getsitepackages", list)())
    user = getattr(site, "getusersitepackages", lambda: None)()
    dirs |= {user} if isinstance(user, str) else set()
    return tuple(sorted({form + os.sep for d in dirs if d for form in (os.path.abspath(d), os.path.realpath(d))}))


@functools.lru_cache(maxsize=1)
def _installed_prefixes() -> tuple[str, ...]:
    return ("<frozen ", *installed_dirs())  # (Python's frozen modules: <frozen runpy>)


def is_installed_file(path: str) -> bool:
    """True for a file of installed code (``installed_dirs``, Python's frozen modules), or of this
    package: not the user's own."""
    return path.startswith(_installed_prefixes()) or is_library_file(path)


@functools.lru_cache(maxsize=1)
def _standard_library() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Where Python's standard library lives, and where packages are installed (inside it, often)."""
    paths = sysconfig.get_paths()
    stdlib = {paths.get(key, "") for key in ("stdlib", "platstdlib")}
    forms = tuple(sorted({form + os.sep for d in stdlib if d for form in (os.path.abspath(d), os.path.realpath(d))}))
    return ("<frozen ", *forms), tuple(d for d in installed_dirs() if "-packages" in d)


def _is_standard_library(path: str) -> bool:
    stdlib, installed = _standard_library()
    return path.startswith(stdlib) and not path.startswith(installed)


def _libraries(files: list[str]) -> list[bool]:
    """Which frames of a stack (outermost first, by file) are the library's: its files, the
    standard library's frames it calls (``contextlib`` entering one of its ``with`` blocks), and
    code generated for it that it calls or that calls it (``<string>``: a dataclass's ``__init__``
    checking its fields in the package's ``__post_init__``)."""
    library = [is_library_file(file) for file in files]
    out: list[bool] = []
    for i, (file, mine) in enumerate(zip(files, library)):
        called_by_it = i > 0 and out[i - 1]
        generated = file == "<string>" and (called_by_it or (i + 1 < len(files) and library[i + 1]))
        out.append(mine or generated or (called_by_it and _is_standard_library(file)))
    return out


def user_frames(tb: Optional[TracebackType]) -> Optional[TracebackType]:
    """``tb`` without the frames of library files (a new chain; ``tb`` is left as it is): None
    when no frame is the user's; ``tb`` itself when ``show_full()``."""
    if show_full():
        return tb
    frames = []
    while tb is not None:
        frames.append(tb)
        tb = tb.tb_next
    libraries = _libraries([t.tb_frame.f_code.co_filename for t in frames])
    kept = [t for t, library in zip(frames, libraries) if not library]
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
            libraries = _libraries([f.filename for f in t.stack])
            t.stack = traceback.StackSummary.from_list([f for f, library in zip(t.stack, libraries) if not library])
            todo += [c for c in (t.__cause__, t.__context__) if c is not None]
    return "".join(te.format())


# How the shell that runs the notebook names the file of a cell ("In[3]" for the temporary file
# IPython compiled it from): set by the front end (``ui.tracebacks``); None for other files.
_cell_name: Optional[Callable[[str], Optional[str]]] = None
_FILE_LINE = re.compile(r'File "([^"\n]+)", line (\d+)')


def name_cells_with(name: Optional[Callable[[str], Optional[str]]]) -> None:
    """Set how stacks and tracebacks name the files of notebook cells (the front end calls this once)."""
    global _cell_name
    _cell_name = name


def _cell_of(path: str) -> Optional[str]:
    if _cell_name is None:
        return None
    try:
        return _cell_name(path)
    except Exception:  # noqa: BLE001 - a name is a nicety: never fail a report for it
        return None


def file_name(path: str) -> str:
    """``train.py`` for a file, ``cell In[3]`` for a notebook cell's."""
    cell = _cell_of(path)
    return f"cell {cell}" if cell else os.path.basename(path)


def name_cells_in(text: str) -> str:
    """A traceback's text with each notebook cell's file named as IPython names it
    (``Cell In[3], line 7`` for ``File "/tmp/ipykernel_81/2841.py", line 7``); other files as
    they were.

    >>> name_cells_in('  File "/w/train.py", line 3, in train')
    '  File "/w/train.py", line 3, in train'
    """
    if _cell_name is None:
        return text

    def named(match: re.Match[str]) -> str:
        cell = _cell_of(match.group(1))
        return f"Cell {cell}, line {match.group(2)}" if cell else match.group(0)
    return _FILE_LINE.sub(named, text)
