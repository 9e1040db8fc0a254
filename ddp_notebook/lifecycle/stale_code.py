"""Modules of the user's own that changed on disk after the notebook imported them.

A function or class from a module next to the notebook travels by reference: the workers
import the module's file as it is when they start. Edited after the notebook imported it, the
workers would run the new code while the notebook runs the old (and shows the old in
tracebacks). ``launch`` says so, naming the module and the fix, instead of letting the two differ
unseen.

How a change is seen: Python's bytecode cache (``__pycache__/x.cpython-311.pyc``) records the
modification time and size of the source it was compiled from, and is written when the module is
imported (or reloaded) here. A source whose time or size no longer matches changed since. The
workers never write that cache (``sys.dont_write_bytecode``), so their imports do not hide a change.
Where the notebook writes no cache (``PYTHONDONTWRITEBYTECODE``), the time and size of each module's
file are noted when this package is imported and at every launch (a reload notes them anew): an
edit after that is seen, one between the module's import and the first note is not.
"""
from __future__ import annotations

import functools
import os
import pickletools
import sys
from collections.abc import Iterable
from types import ModuleType
from typing import Any, Optional

from ..core.tracebacks import is_installed_file

__all__ = ["changed_modules", "changed_modules_in", "stale_code_notice"]


def _compiled_from(cached: str) -> Optional[tuple[int, int]]:
    """The (mtime, size) of the source a bytecode cache file was compiled from (PEP 552: a
    timestamp-based pyc), or None when there is no such file or it records a hash instead."""
    try:
        with open(cached, "rb") as f:
            header = f.read(16)
    except OSError:
        return None
    if len(header) < 16 or int.from_bytes(header[4:8], "little") != 0:
        return None
    return int.from_bytes(header[8:12], "little"), int.from_bytes(header[12:16], "little")


# A module file -> whether it is the user's own (not installed code, not this package's).
_own: dict[str, bool] = {}
# Module name -> the module, once seen not to be the user's own (installed code, this package's,
# no source file): a launch looks at every module, and these ~1,400 need no second look.
_not_own: dict[str, ModuleType] = {}
# Where no bytecode cache tells: module name -> (its spec when noted, which a reload replaces;
# the file's (mtime, size) then).
_noted: dict[str, tuple[Any, tuple[int, int]]] = {}


def _real_path(path: str) -> str:
    """``os.path.realpath(path)``, each folder above resolved once for every module under it (a
    realpath looks at every folder above: 1,400 of torch's modules took 10 ms), one look at
    the file or folder itself."""
    folder, name = os.path.split(path)
    if not os.path.isabs(path) or name in ("", ".", "..") or folder == path or os.path.islink(path):
        return os.path.realpath(path)
    return os.path.join(_real_folder(folder), name)


@functools.cache
def _real_folder(path: str) -> str:
    return _real_path(path)


def _changed(name: str, module: ModuleType) -> Optional[str]:
    """The source file of ``module`` when it is the user's own and changed since it was imported."""
    source = getattr(module, "__file__", None)
    if not isinstance(source, str) or not source.endswith(".py"):
        _not_own[name] = module
        return None
    own = _own.get(source)
    if own is None:  # resolved once per file: a launch looks at every module
        real = _real_path(source)
        own = _own[source] = not is_installed_file(real)
    if not own:
        _not_own[name] = module
        return None
    try:
        st = os.stat(source)
    except OSError:
        return None
    now = (int(st.st_mtime) & 0xFFFFFFFF, st.st_size & 0xFFFFFFFF)  # as a bytecode cache records them
    cached = getattr(module, "__cached__", None)
    compiled = _compiled_from(cached) if isinstance(cached, str) and not sys.dont_write_bytecode else None
    if compiled is not None:
        return source if compiled != now else None
    spec = getattr(module, "__spec__", None)
    noted = _noted.get(name)
    if noted is None or noted[0] is not spec:  # first seen, or reloaded since: as it is now
        _noted[name] = (spec, now)
        return None
    return source if noted[1] != now else None


def changed_modules(names: Optional[Iterable[str]] = None) -> dict[str, str]:
    """The user's own modules (of ``names``, or all imported) whose file changed on disk after the
    notebook imported them: name → file."""
    modules = sys.modules if names is None else {n: sys.modules[n] for n in names if n in sys.modules}
    found = {}
    for name, module in list(modules.items()):
        if _not_own.get(name) is module or not isinstance(module, ModuleType):
            continue
        path = _changed(name, module)
        if path is not None:
            found[name] = path
    return found


def changed_modules_in(pickled: bytes) -> dict[str, str]:
    """The changed modules (``changed_modules``) that the pickled call refers to: a function or
    class of theirs travels by reference, and the workers import them anew."""
    changed = changed_modules()
    if not changed:  # the usual case: nothing to read the pickle for
        return {}
    named: set[str] = set()
    try:
        for _op, arg, _pos in pickletools.genops(pickled):
            if isinstance(arg, str):
                named.add(arg.split(" ")[0])  # GLOBAL's argument is "module name"
    except Exception:  # noqa: BLE001 - a pickle it cannot read: say nothing rather than fail a launch
        return {}
    return {name: path for name, path in changed.items() if name in named}


def stale_code_notice(pickled: bytes) -> Optional[str]:
    """What ``launch`` prints when the call refers to a module that changed after it was imported."""
    changed = changed_modules_in(pickled)
    if not changed:
        return None
    names = sorted(changed)
    listed = ", ".join(f"{name} ({os.path.relpath(changed[name])})" for name in names)
    reload = "; ".join(f"importlib.reload({name})" for name in names)
    return (f"ddp_notebook: {listed} changed on disk after the notebook imported it: the workers import the file "
            "as it is now, while the notebook runs the version it imported. To run the same code in both, "
            f"import importlib; {reload} (or %load_ext autoreload and %autoreload 2), then launch again.")


changed_modules()  # the modules imported before this package: noted now
