"""What a session's requests take from the notebook: the functions, classes and modules a cell
names (sent as a launch sends its function), never the names each rank has of its own or that
the cell binds itself; and the values ``Session.push`` sends (placed as a launch's data is).
"""
from __future__ import annotations

import inspect
import symtable
import types
from typing import Any, Optional

from ..transfer import packing, pickling
from .call import cell_sources, pack_naming

__all__ = ["RANK_NAMES", "notebook_names", "cell_binds", "new_sources", "pickled_names", "packed"]

#: The names every rank's namespace starts with (never sent from the notebook).
RANK_NAMES = frozenset({"rank", "world_size", "ctx", "torch", "dist"})


def notebook_names(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """The functions, classes and modules of ``namespace`` that ``code`` names: what a cell takes
    from the notebook (data is sent with ``push``).

    >>> import math
    >>> def f(): pass
    >>> sorted(notebook_names("f(math.pi) + x", {"f": f, "math": math, "x": 1}))
    ['f', 'math']

    A name the cell binds itself (``f = 3``, ``def f``, ``import f``) is the rank's: the
    notebook's ``f`` is not sent. What a function of the cell binds inside (a parameter) is its
    own, and leaves the cell's name the notebook's (Python's own scopes, ``symtable``, say which).

    >>> notebook_names("f = 3; f + 1", {"f": f})
    {}
    >>> sorted(notebook_names("def loss(math=None):\\n    return 0\\nmath.pi", {"math": math}))
    ['math']
    """
    out = {}
    for name in sorted(_read_from_notebook(code) - RANK_NAMES):
        if name in namespace:
            value = namespace[name]
            if isinstance(value, types.ModuleType) or inspect.isfunction(value) or inspect.isclass(value) \
                    or inspect.isbuiltin(value):
                out[name] = value
    return out


def _read_from_notebook(code: str) -> set[str]:
    """The global names ``code`` reads (at its top level, or inside its functions, classes,
    lambdas and comprehensions) that it does not bind at its top level."""
    top = symtable.symtable(code, "<ddp cell>", "exec")
    read = {s.get_name() for s in top.get_symbols() if s.is_referenced()}
    todo = list(top.get_children())
    while todo:
        table = todo.pop()
        read.update(s.get_name() for s in table.get_symbols() if s.is_referenced() and s.is_global())
        todo.extend(table.get_children())
    return read - cell_binds(top)


def cell_binds(code: Any) -> set[str]:
    """The names a cell binds at its top level (``x = ...``, ``def``, ``class``, ``import``):
    the rank's own, never taken from the notebook. ``code``: its text, or its ``symtable``.

    >>> sorted(cell_binds("import os\\nz()\\ndef z(): pass"))
    ['os', 'z']
    """
    top = symtable.symtable(code, "<ddp cell>", "exec") if isinstance(code, str) else code
    return {s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported() or s.is_namespace()}


def new_sources(sent: set[str]) -> dict[str, Any]:
    """The notebook cells' sources (``call.cell_sources``) not in ``sent`` yet, which is updated."""
    new = {name: entry for name, entry in cell_sources().items() if name not in sent}
    sent.update(new)
    return new


def pickled_names(code: str, namespace: dict[str, Any]) -> bytes:
    """The notebook's names ``code`` uses (``notebook_names``), pickled.

    Raises
    ------
    NotPicklableError
        One of them cannot be sent (named).
    """
    names = notebook_names(code, namespace)
    parts = [(f"the notebook's {k!r}, which the cell uses,", v) for k, v in names.items()]
    return pack_naming(pickling.dumps, names, parts, "the values", "dict")


def packed(values: dict[str, Any], by_value: bool = False) -> tuple[bytes, Optional[packing.Placement]]:
    """The values to push: their large tensors and arrays placed once in shared memory, each
    rank mapping them (copy-on-write), as a launch sends its data; pickled whole where memory
    cannot be shared, or ``by_value`` (ranks on engines, which may be on other hosts).

    Raises
    ------
    NotPicklableError
        A value cannot be sent (named).
    SharedDataError
        A value's data cannot be placed (a file it is mapped from changed), as for a launch.
    """
    parts = [(f"the value of {k!r}", v) for k, v in values.items()]
    if by_value or not packing.supported():
        return pack_naming(pickling.dumps, values, parts, "the values", "dict"), None
    packed = pack_naming(packing.pack, values, parts, "the values", "dict")
    return packed.data, packed.place()
