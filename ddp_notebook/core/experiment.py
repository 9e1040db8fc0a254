"""What a run was, as plain data: its name and tags (checked), its configuration (the call's
arguments bound to the function's parameter names, each summarized so a record never holds a
dataset), a fingerprint of its code, and what sets runs apart (the config values that differ).

>>> def train(ctx, data, lr=0.1, epochs=3): ...
>>> class Tensor:                      # what a torch tensor looks like to the core (no torch here)
...     shape, dtype = (896, 8), "torch.float32"
>>> call_config(train, "ctx", (Tensor(),), {"lr": 0.01})
{'data': 'Tensor[896, 8] float32', 'lr': 0.01, 'epochs': 3}
>>> differing([{"lr": 0.1, "epochs": 3}, {"lr": 0.01, "epochs": 3}])
['lr']
"""
from __future__ import annotations

import hashlib
import inspect
import math
import numbers
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Optional

from .bounds import cut
from .errors import LaunchOptionError

__all__ = ["check_name", "check_tags", "summarize", "describe_callable", "function_name", "call_config",
           "code_fingerprint", "differing", "bounded_config", "check_monitor", "NAME_CHARS", "TAGS_KEPT", "TAG_CHARS",
           "CONFIG_KEYS", "CONFIG_TEXT", "MODES"]

NAME_CHARS = 200
"""Characters a run's name may have."""
TAGS_KEPT = 50
"""Tags a run may have."""
TAG_CHARS = 250
"""Characters of a tag's key, and of a tag's text value (MLflow's and W&B's limits are wider)."""
CONFIG_KEYS = 200
"""Entries a run's config keeps (the first ones)."""
CONFIG_TEXT = 200
"""Characters kept of a text in a config (a long string is no parameter)."""
ITEMS_KEPT = 20
"""Items of a list, tuple or dict kept as they are in a config; a longer one is data, summarized."""
MODES = ("min", "max")
"""Whether a lower or a higher monitored value is better."""

_TAG_KEY = re.compile(r"[\w.\-/ :]+")  # (what MLflow takes as a key: letters of any script too)
# The marks and overrides of text direction: a name that holds one shows other than it reads
# ("\u202eevil" shows as "live"), and turns the rest of its line in a list of runs around.
_DIRECTION_MARKS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")


def check_name(value: Any) -> Optional[str]:
    """A run's name: None, or text of 1 to ``NAME_CHARS`` characters on one line.

    >>> check_name("lr=0.1 baseline")
    'lr=0.1 baseline'
    >>> check_name(3)
    Traceback (most recent call last):
    ...
    ddp_notebook.errors.LaunchOptionError: name must be text (such as 'baseline' or 'lr=0.1') or None, not 3
    """
    if value is None:
        return None
    if not isinstance(value, str):
        raise LaunchOptionError(f"name must be text (such as 'baseline' or 'lr=0.1') or None, not {value!r}")
    text = value.strip()
    if not text or len(text) > NAME_CHARS or not _one_line(text):
        raise LaunchOptionError(f"name must be 1 to {NAME_CHARS} characters on one line, with no control character "
                                f"(a tab, a newline, an escape, a mark of text direction), not {cut(value, 80)!r}")
    return text


def _one_line(text: str) -> bool:
    """Whether ``text`` shows on one line as it reads: no control character, no line or
    paragraph separator, no mark of text direction."""
    return not any(unicodedata.category(ch) in ("Cc", "Zl", "Zp") or ch in _DIRECTION_MARKS for ch in text)


def _short_scalar(value: Any) -> bool:
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, (int, float)):
        return not isinstance(value, float) or math.isfinite(value)
    return isinstance(value, str) and len(value) <= TAG_CHARS and _one_line(value)


def check_tags(value: Any) -> dict[str, Any]:
    """A run's tags: a dict of at most ``TAGS_KEPT`` short keys (letters, digits, ``_ . - / :``
    and spaces) to short scalars (text of at most ``TAG_CHARS`` characters on one line, finite
    numbers, True/False); None is none.

    >>> check_tags({"lr": 0.1, "arch": "cnn"})
    {'lr': 0.1, 'arch': 'cnn'}
    >>> check_tags({"data": [1, 2]})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    ddp_notebook.errors.LaunchOptionError: tags['data'] is [1, 2]: a tag's value is short text (...), a finite ...
    """
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise LaunchOptionError(f"tags must be a dict of short names to short text or numbers, such as "
                                f"{{'lr': 0.1, 'arch': 'cnn'}}, not {cut(repr(value), 80)}")
    if len(value) > TAGS_KEPT:
        raise LaunchOptionError(f"tags has {len(value)} entries: a run takes at most {TAGS_KEPT}")
    out: dict[str, Any] = {}
    for key, item in value.items():
        if not isinstance(key, str) or not key or len(key) > TAG_CHARS or not _TAG_KEY.fullmatch(key):
            raise LaunchOptionError(f"tags has the key {cut(repr(key), 80)}: a tag's key is text of letters, digits, "
                                    f"'_', '.', '-', '/', ':' and spaces, at most {TAG_CHARS} characters")
        if item is None or not _short_scalar(item):
            raise LaunchOptionError(f"tags[{key!r}] is {cut(repr(item), 80)}: a tag's value is short text (at most "
                                    f"{TAG_CHARS} characters on one line, with no control character such as a tab, "
                                    "an escape or a mark of text direction), a finite number or True/False")
        out[key] = item
    return out


def check_monitor(monitor: Any, mode: Any, caller: str) -> None:
    """``monitor`` (the name of a logged value, or None) and ``mode`` ('min' or 'max'), said in
    ``caller``'s words when they cannot work."""
    if monitor is not None and (not isinstance(monitor, str) or not monitor.strip()):
        raise LaunchOptionError(f"{caller}()'s monitor must be the name of a value the function logs with "
                                f"ctx.log (such as 'valid_loss') or None, not {monitor!r}")
    if mode is not None and mode not in MODES:
        raise LaunchOptionError(f"{caller}()'s mode must be 'min' (lower is better) or 'max', not {mode!r}")


# ---- summaries ----------------------------------------------------------------------------------

def _count(n: int) -> str:
    for size, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if n >= size:
            return f"{n / size:.3g}{suffix}"
    return str(n)


def _shape_text(value: Any) -> Optional[str]:
    """``Tensor[896, 8] float32`` for what has a shape and a dtype (a tensor, an array), else None."""
    shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
    if shape is None or dtype is None or isinstance(value, type):
        return None
    try:
        dims = ", ".join(str(int(d)) for d in shape)
    except (TypeError, ValueError):
        return None
    kind = str(dtype).replace("torch.", "")
    return f"{type(value).__name__}[{dims}] {kind}"


def _module_text(value: Any) -> Optional[str]:
    """``Net (12.3k parameters)`` for a torch module (``MSELoss()`` without parameters), else None."""
    parameters = getattr(value, "parameters", None)
    if not callable(parameters) or not callable(getattr(value, "state_dict", None)) or not hasattr(value, "training"):
        return None
    try:
        n = sum(int(p.numel()) for p in parameters())
    except Exception:  # noqa: BLE001 - a module whose parameters cannot be counted is still named
        return f"{type(value).__name__}"
    return f"{type(value).__name__}()" if n == 0 else f"{type(value).__name__} ({_count(n)} parameters)"


def _qualified(obj: Any) -> str:
    """``torch.optim.SGD`` (the shortest module path that holds it), ``train`` (the notebook's own),
    ``<lambda>`` (a function made inside another: its name alone)."""
    module = getattr(obj, "__module__", None) or ""
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or type(obj).__name__
    if "<locals>" in name:
        return str(getattr(obj, "__name__", name))
    if module in ("", "__main__", "builtins"):
        return name
    parts = module.split(".")
    for i in range(1, len(parts)):  # torch.optim.sgd.SGD is torch.optim.SGD to its users
        holder = sys.modules.get(".".join(parts[:i]))
        if holder is not None and "." not in name and getattr(holder, name, None) is obj:
            return f"{'.'.join(parts[:i])}.{name}"
    return f"{module}.{name}"


def function_name(fn: Any) -> str:
    """A function as a run's config names it: ``train``, ``mypackage.train``, ``<lambda>``."""
    return cut(_qualified(fn), CONFIG_TEXT)


def _lambda_source(fn: Any) -> Optional[str]:
    """The text of a lambda (``lambda p: SGD(p, lr=0.1)``) when its line holds only one, read from
    its source up to the comma or bracket that ends it; None when it cannot be told."""
    import ast

    try:
        lines, first = inspect.findsource(fn)
    except (OSError, TypeError, IndexError):
        return None
    text = "".join(lines[first:first + 10])
    found = []
    for start in (m.start() for m in re.finditer(r"\blambda\b", text.split("\n", 1)[0])):
        expression = _balanced(text, start)
        try:
            tree = ast.parse(expression, mode="eval")
        except SyntaxError:
            continue
        if isinstance(tree.body, ast.Lambda):
            found.append(" ".join(ast.unparse(tree.body).split()))
    return found[0] if len(found) == 1 else None


def _balanced(text: str, start: int) -> str:
    """``text`` from ``start`` up to the first comma, closing bracket or line end outside brackets
    and strings (where an expression written in a call or an assignment ends)."""
    depth, i, quote = 0, start, ""
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif ch == quote:
                quote = ""
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif ch in ",#\n" and depth == 0:
            break
        i += 1
    return text[start:i]


def _captured_scalars(fn: Any) -> dict[str, Any]:
    """The plain values a function closes over or reads as globals (``lr`` in ``lambda p: SGD(p,
    lr=lr)``), as they are now: what a lambda's text alone does not say."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return {}
    found: dict[str, Any] = {}
    for var, cell in zip(code.co_freevars, getattr(fn, "__closure__", None) or ()):
        try:
            found[var] = cell.cell_contents
        except ValueError:
            continue
    names = getattr(fn, "__globals__", {})
    found.update({var: names[var] for var in code.co_names if var in names and var not in found})
    return {k: v for k, v in found.items() if _short_scalar(v) and (not isinstance(v, str) or len(v) <= 40)}


def describe_callable(fn: Any) -> str:
    """A function as a config shows it: its qualified name (``torch.optim.SGD``, ``train``), a
    partial with its arguments, a lambda by its text, with the plain values it closes over.

    >>> import functools
    >>> describe_callable(functools.partial(max, default=0))
    'functools.partial(max, default=0)'
    >>> lr = 0.1
    >>> describe_callable((lambda lr: (lambda p: (p, lr)))(lr))
    '<lambda> [lr=0.1]'
    """
    import functools

    if isinstance(fn, functools.partial):
        parts = [describe_callable(fn.func)] + [_inline(summarize(a)) for a in fn.args]
        parts += [f"{k}={_inline(summarize(v))}" for k, v in fn.keywords.items()]
        return cut(f"functools.partial({', '.join(parts)})", CONFIG_TEXT)
    text = _qualified(fn)
    if getattr(fn, "__name__", None) == "<lambda>":
        text = _lambda_source(fn) or text
    captured = _captured_scalars(fn)
    if captured:  # (a float to 6 significant digits: an Optuna trial's lr is 0.0443038, not 17 digits)
        text += " [" + ", ".join(f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v!r}"
                                 for k, v in captured.items()) + "]"
    return cut(text, CONFIG_TEXT)


def _inline(value: Any) -> str:
    return value if isinstance(value, str) else repr(value)


def summarize(value: Any, depth: int = 0) -> Any:
    """``value`` as a config keeps it (JSON): numbers, text (cut at ``CONFIG_TEXT``), None and
    True/False as they are, small lists, tuples and dicts of them alike; tensors and arrays as
    ``Tensor[896, 8] float32``, a module as ``Net (12.3k parameters)``, a dataset as
    ``TensorDataset[896]``, a function by its name, anything else by its type.

    >>> summarize([1, 2.5, "a", None]), summarize(list(range(100)))
    ([1, 2.5, 'a', None], 'list[100]')
    """
    try:
        return _summary(value, depth)
    except Exception:  # noqa: BLE001 - an object whose attributes raise: named by its type
        return _qualified(type(value))


def _summary(value: Any, depth: int) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else str(number)
    if isinstance(value, str):
        return cut(value, CONFIG_TEXT)
    if isinstance(value, bytes):
        return f"bytes[{len(value)}]"
    shaped = _shape_text(value)
    if shaped is not None:
        if getattr(value, "shape", None) == () and callable(getattr(value, "item", None)):
            try:
                return summarize(value.item(), depth)  # a 0-d tensor or a numpy scalar: its number
            except Exception:  # noqa: BLE001 - its shape says enough
                return shaped
        return shaped
    module = _module_text(value)
    if module is not None:
        return module
    if isinstance(value, (list, tuple)):
        if len(value) > ITEMS_KEPT or depth >= 3:
            return f"{type(value).__name__}[{len(value)}]"
        return [summarize(v, depth + 1) for v in value]
    if isinstance(value, Mapping):
        if len(value) > ITEMS_KEPT or depth >= 3 or not all(isinstance(k, (str, int)) for k in value):
            return f"{type(value).__name__}[{len(value)}]"
        return {str(k): summarize(v, depth + 1) for k, v in value.items()}
    if isinstance(value, type) or callable(value):
        return describe_callable(value)
    if hasattr(value, "__len__") and hasattr(value, "__getitem__"):
        try:
            return f"{type(value).__name__}[{len(value)}]"
        except Exception:  # noqa: BLE001 - a length that cannot be read
            return type(value).__name__
    text = _plain_repr(value)
    return text if text is not None else _qualified(type(value))


def _plain_repr(value: Any) -> Optional[str]:
    """A short repr that says something (``PosixPath('/data')``), not ``<X object at 0x...>``."""
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a broken __repr__
        return None
    return text if len(text) <= 80 and " at 0x" not in text else None


def call_config(fn: Callable[..., Any], first: Optional[str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> \
        dict[str, Any]:
    """The call's arguments bound to ``fn``'s parameter names (defaults filled in), each
    summarized; ``first`` names what the workers pass before ``args`` (``"ctx"``, ``"rank"``),
    which is left out. A ``**kwargs`` parameter's entries are entries of their own; a
    signature that cannot be read keeps ``args`` and ``kwargs``.
    """
    try:
        signature = inspect.signature(fn)
        bound = signature.bind(*(["?"] if first else []), *args, **kwargs)
    except (TypeError, ValueError):
        return bounded_config({"args": summarize(list(args)), **{k: summarize(v) for k, v in kwargs.items()}})
    bound.apply_defaults()
    out: dict[str, Any] = {}
    params = list(signature.parameters.values())
    for i, (name, value) in enumerate(bound.arguments.items()):
        if first and i == 0:
            continue
        kind = signature.parameters[name].kind if name in signature.parameters else params[-1].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            for key, item in value.items():
                out.setdefault(key, summarize(item))
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                out[name] = summarize(list(value))
        else:
            out[name] = summarize(value)
    return bounded_config(out)


def bounded_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with at most ``CONFIG_KEYS`` entries and keys of at most 100 characters."""
    return {cut(str(k), 100): v for k, v in list(config.items())[:CONFIG_KEYS]}


def code_fingerprint(objects: Iterable[Any]) -> Optional[str]:
    """12 hex digits that change when the code of ``objects`` changes (a function's source, a
    class's methods, a module's class): what tells two runs of "the same" function apart after
    an edit. None when none of them has code to read.

    >>> def f(x): return x + 1
    >>> def g(x): return x + 2
    >>> code_fingerprint([f]) != code_fingerprint([g]), len(code_fingerprint([f]))
    (True, 12)
    """
    digest = hashlib.sha256()
    found = False
    for obj in objects:
        for text in _code_texts(obj):
            digest.update(text.encode("utf-8", "replace"))
            found = True
    return digest.hexdigest()[:12] if found else None


def _code_texts(obj: Any, depth: int = 0) -> list[str]:
    import functools

    if obj is None or depth > 2:
        return []
    if isinstance(obj, functools.partial):
        return _code_texts(obj.func, depth + 1)
    if callable(getattr(obj, "parameters", None)) and not isinstance(obj, type):
        obj = type(obj)  # a module instance: its class's code
    target = obj.__func__ if hasattr(obj, "__func__") else obj
    try:
        return [inspect.getsource(target)]
    except (OSError, TypeError):
        pass
    code = getattr(target, "__code__", None)
    if code is not None:
        return [repr((code.co_code, code.co_consts, code.co_names))]
    if isinstance(target, type):  # a class defined in a notebook cell: its methods' code
        return [t for value in vars(target).values() if callable(value) or hasattr(value, "__func__")
                for t in _code_texts(value, depth + 1)]
    return []


# ---- what sets runs apart -------------------------------------------------------------------------

_MISSING = object()


def differing(configs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The keys whose values are not the same in every config (one missing from some counts as
    differing), in the order they first appear.

    >>> differing([{"lr": 0.1, "seed": 0}, {"lr": 0.1}])
    ['seed']
    """
    keys: list[str] = []
    for config in configs:
        keys += [k for k in config if k not in keys]
    return [k for k in keys if len({_key_of(c.get(k, _MISSING)) for c in configs}) > 1]


def _key_of(value: Any) -> str:
    return "<missing>" if value is _MISSING else repr(value)
