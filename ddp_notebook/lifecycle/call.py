"""Packing a call for the workers: cloudpickle by value, so functions defined in notebook cells,
closures and lambdas travel; and when something cannot travel, saying which piece it is.
"""
from __future__ import annotations

import inspect
import linecache
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, TypeVar

from ..core.errors import ArgumentsError, DDPNotebookError, NotPicklableError, SharedDataError
from ..transfer.packing import Packed, pack
from .stale_code import stale_code_notice

__all__ = ["Call", "cell_sources", "pack_call", "pack_naming", "first_unpicklable", "check_arguments", "call_parts"]


def _describe(obj: Any) -> str:
    kind = type(obj)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:
        return False
    return True


def _captured(fn: Callable[..., Any]) -> list[tuple[str, Any]]:
    """The variables a function closes over or reads as globals: the usual culprits."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return []
    name = getattr(fn, "__name__", "fn")
    out = [(f"{var!r}, used by the function {name!r},", cell.cell_contents)
           for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()) if _filled(cell)]
    glb = getattr(fn, "__globals__", {})
    out += [(f"the global {var!r}, used by the function {name!r},", glb[var])
            for var in code.co_names if var in glb and not isinstance(glb[var], type(linecache))]
    return out


def first_unpicklable(parts: Sequence[tuple[str, Any]]) -> Optional[NotPicklableError]:
    """The error for the first of ``(description, object)`` that cannot be pickled, else None.
    Tensors and arrays are pickled as they travel, by reference: checking a model or a dataset
    does not copy its data."""
    for what, obj in parts:
        try:
            pack(obj)
        except Exception as e:  # noqa: BLE001 - pickling raises many types
            for inner_what, inner in _captured(obj) if callable(obj) else []:
                try:
                    pack(inner)
                except Exception as inner_e:  # noqa: BLE001
                    return NotPicklableError(inner_what, _describe(inner), str(inner_e) or type(inner_e).__name__)
            return NotPicklableError(what, _describe(obj), str(e) or type(e).__name__)
    return None


def call_parts(caller: str, fn: Any, args: Any, kwargs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``fn``, ``args`` and ``kwargs`` of ``launch``/``spawn`` checked for what they are (a function,
    a tuple or list, a dict with names for keys), as ``(args, kwargs)``: a string is not split into
    its characters."""
    if not callable(fn):
        raise ArgumentsError(f"{caller}() needs a function to run, not {fn!r}")
    if not isinstance(args, (tuple, list)):
        raise ArgumentsError(f"{caller}()'s args is a tuple (or list) of the function's arguments, such as "
                             f"(100,), not {args!r}")
    if kwargs is not None and (not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs)):
        raise ArgumentsError(f"{caller}()'s kwargs is a dict of the function's keyword arguments, such as "
                             f"{{'lr': 0.1}}, not {kwargs!r}")
    return tuple(args), dict(kwargs or {})


# A first parameter with one of these names (or containing "ctx" or "context") is taken to be there
# for the worker context; any other name is read as a mistake unless annotated as the context.
_CONTEXT_NAMES = frozenset({"c", "w", "_", "worker", "self"})


def _signature_text(fn: Callable[..., Any], signature: inspect.Signature, add: str = "") -> str:
    """``train(steps)``, or with a parameter ``add`` first: ``train(ctx, steps)``."""
    params = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
    if add:
        params.insert(0, inspect.Parameter(add, inspect.Parameter.POSITIONAL_OR_KEYWORD))
    return f"{getattr(fn, '__name__', 'fn')}{signature.replace(parameters=params, return_annotation=signature.empty)}"


def _takes_context(param: inspect.Parameter) -> bool:
    """Whether ``param``, the first of a function run by ``launch``, is there for the context."""
    if param.kind is param.VAR_POSITIONAL:  # fn(*args): it gets it as args[0]
        return True
    if param.kind not in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) or param.default is not param.empty:
        return False  # a keyword-only parameter, or one with a default, is not for the context
    note = param.annotation
    if note is not param.empty:
        text = note if isinstance(note, str) else getattr(note, "__name__", repr(note))
        return "context" in text.lower() or text in ("Any", "typing.Any", "object")
    name = param.name.lower()
    return "ctx" in name or "context" in name or name in _CONTEXT_NAMES


def check_arguments(fn: Callable[..., Any], first: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise ``ArgumentsError`` now when ``fn(<first>, *args, **kwargs)`` cannot bind to ``fn``'s
    signature (every worker would fail the same way); silent when the signature cannot be read.

    For ``first="ctx"`` the function's first parameter must be there for the worker context: named
    ``ctx``, ``context`` (or containing either), or annotated as the context. A function written
    without it would receive the context in its first argument and fail far from the mistake.

    Parameters
    ----------
    fn : callable
        The function the workers will call.
    first : str
        What the workers pass first: ``"ctx"`` (``launch``, ``fit``) or ``"rank"`` (``spawn``).
    args, kwargs
        The rest of the call.

    Raises
    ------
    ArgumentsError
        The call cannot bind, or the function does not take the worker context first.

    >>> def train(ctx, steps): ...
    >>> check_arguments(train, "ctx", (1, 2), {})
    Traceback (most recent call last):
    ...
    ddp_notebook.errors.ArgumentsError: train(ctx, ...) cannot take these arguments: too many positional arguments
    >>> def train(steps): ...
    >>> check_arguments(train, "ctx", (), {})
    Traceback (most recent call last):
    ...
    ddp_notebook.errors.ArgumentsError: train(steps) does not take the worker context: write def train(ctx, steps) (...
    """
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or a C function: the workers will say
        return
    name = getattr(fn, "__name__", "the function")
    if first == "ctx":
        params = list(signature.parameters.values())
        if not params or not _takes_context(params[0]):
            shown, fixed = _signature_text(fn, signature), "def " + _signature_text(fn, signature, add="ctx")
            if name == "<lambda>":
                shown, fixed = "the lambda", "lambda " + _signature_text(fn, signature, add="ctx")[9:-1] + ": ..."
            raise ArgumentsError(
                f"{shown} does not take the worker context: write {fixed} (the workers call "
                f"{name}(ctx, *args, **kwargs); its first parameter receives the context, so name it ctx or "
                "context, or annotate it as WorkerContext)")
    try:
        signature.bind(first, *args, **kwargs)
    except TypeError as e:
        raise ArgumentsError(f"{name}({first}, ...) cannot take these arguments: {e}") from None


def cell_sources() -> dict[str, Any]:
    """The notebook cells' sources (IPython's entries in ``linecache``, which only this process
    has): sent with a call or a session's cell, so that a traceback raised on a rank shows the
    cell's lines."""
    return {name: entry for name, entry in list(linecache.cache.items()) if len(entry) == 4 and entry[1] is None}


def pack_call(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Packed:
    """cloudpickle the call, its large tensors and arrays by reference (``transfer.packing``: they
    are placed in shared memory when the run starts); on failure, find the piece that cannot be
    pickled and say which.

    >>> from ddp_notebook.transfer.pickling import loads
    >>> loads(pack_call(len, ([1, 2],), {}).data)["args"]
    ([1, 2],)
    """
    parts = [(f"the function {getattr(fn, '__name__', repr(fn))!r}", fn)]
    parts += [(f"argument args[{i}]", a) for i, a in enumerate(args)]
    parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
    return pack_naming(pack, {"fn": fn, "args": args, "kwargs": kwargs, "sources": cell_sources()}, parts,
                       "the call", "function call")


_Packed = TypeVar("_Packed")


def pack_naming(packer: Callable[[Any], _Packed], value: Any, parts: Sequence[tuple[str, Any]], what: str,
                kind: str) -> _Packed:
    """``packer(value)`` (``transfer.packing.pack``, or ``pickling.dumps`` for a value that goes
    whole); where it cannot be pickled, the ``NotPicklableError`` that names the first of
    ``parts`` (name, object) that cannot, else ``what`` (a ``kind``) whole.

    Raises
    ------
    NotPicklableError
        A piece cannot be pickled.
    SharedDataError
        The data itself cannot be placed (a file it is mapped from changed): it says which.
    """
    try:
        return packer(value)
    except SharedDataError:
        raise
    except Exception as whole:  # noqa: BLE001 - pickling raises many types
        raise (first_unpicklable(parts) or NotPicklableError(what, kind, str(whole))) from None


@dataclass(eq=False)
class Call:
    """The function and arguments of a run, as the notebook holds them: every start (the launch,
    each retry) packs them anew, so a retry sends them as they are then, every piece alike, as
    running the cell again would. ``release(why)`` lets go of them (the notebook may then free
    data it deleted); a start after that raises ``DDPNotebookError`` with ``why``."""

    fn: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    released: Optional[str] = None  # why it was let go
    has_data: bool = False  # its last pack had tensors or arrays by reference: worth letting go
    saved_payload: Optional[bytes] = None  # a call read back from a run's directory: sent as it was saved

    @classmethod
    def saved(cls, payload: bytes) -> Call:
        """The call of a run loaded from disk: the pickle kept when it was launched."""
        return cls(None, (), saved_payload=payload)

    def pack(self) -> Packed:
        """The call packed as it is now (``pack_call``), or as it was saved."""
        if self.released is not None:
            raise DDPNotebookError(self.released)
        if self.saved_payload is not None:
            return Packed(self.saved_payload)
        packed = pack_call(self.fn, self.args, self.kwargs)
        self.has_data = bool(packed.pieces)
        notice = stale_code_notice(packed.data)
        if notice is not None:  # said at every start: the workers would run other code than the notebook
            print(notice, file=sys.stderr)
        return packed

    def release(self, why: str) -> None:
        if self.released is None:
            self.fn, self.args, self.kwargs, self.released = None, (), {}, why
