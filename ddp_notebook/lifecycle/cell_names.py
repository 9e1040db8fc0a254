"""What a session cell takes from the notebook: the functions, classes and modules it names
(sent as a launch sends its function), never the names each rank has of its own or that the
cell binds itself. Data goes to the ranks with ``Session.push``.
"""
from __future__ import annotations

import ast
import inspect
import types
from typing import Any

__all__ = ["RANK_NAMES", "notebook_names"]

#: The names every rank's namespace starts with (never sent from the notebook).
RANK_NAMES = frozenset({"rank", "world_size", "ctx", "torch", "dist"})


def notebook_names(code: str, namespace: dict[str, Any]) -> dict[str, Any]:
    """The functions, classes and modules of ``namespace`` that ``code`` names: what a cell takes
    from the notebook (data is sent with ``push``).

    >>> import math
    >>> def f(): pass
    >>> sorted(notebook_names("f(math.pi) + x", {"f": f, "math": math, "x": 1}))
    ['f', 'math']

    A name the cell binds itself (``f = 3``, ``def f``, ``import f``, a parameter) is the rank's:
    the notebook's ``f`` is not sent.

    >>> notebook_names("f = 3; f + 1", {"f": f})
    {}
    """
    nodes = list(ast.walk(ast.parse(code)))
    used = {node.id for node in nodes if isinstance(node, ast.Name)}
    out = {}
    for name in sorted(used - RANK_NAMES - _bound_in(nodes)):
        if name in namespace:
            value = namespace[name]
            if isinstance(value, types.ModuleType) or inspect.isfunction(value) or inspect.isclass(value) \
                    or inspect.isbuiltin(value):
                out[name] = value
    return out


def _bound_in(nodes: list[ast.AST]) -> set[str]:
    """The names a cell binds: assigned, defined, imported, a parameter, an exception's name."""
    bound: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Name) and isinstance(node.ctx, (ast.Store, ast.Del)):
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
    return bound


