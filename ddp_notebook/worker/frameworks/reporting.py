"""What every framework's reporter shares: the rank's context, the switch, plain metrics."""
from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Callable, Mapping
from typing import Any, Optional

from ...core.switches import switched_on
from ..context import current_context

__all__ = ["SWITCH_ENV", "PROGRESS_MARK", "enabled", "scalars", "finite_int", "epoch_of", "patch_init",
           "wrap_method", "guarded", "stop_agreed"]

SWITCH_ENV = "DDP_NOTEBOOK_FRAMEWORK_PROGRESS"
# What ctx.log takes by name: never passed on as a metric of the same name.
_RESERVED = frozenset({"step", "total", "epoch", "epochs"})
# Marks our reporting callbacks: one made from a copy of the class (pickled by value into the
# worker) is still ours, and the Trainer gets no second one.
PROGRESS_MARK = "_ddp_notebook_progress"
_MARK = "_ddp_notebook_patched"
_failed = False  # a reporter failed once: said once


def enabled() -> bool:
    """False when the user turned framework progress off."""
    return switched_on(SWITCH_ENV)


def scalars(values: Optional[Mapping[str, Any]]) -> dict[str, Any]:
    """The metrics ``ctx.log`` can show: numbers, strings and one-element tensors, finite or not,
    under their own names (``step``, ``total`` and ``epoch`` are ctx.log's own)."""
    out: dict[str, Any] = {}
    for name, value in (values or {}).items():
        name = str(name)
        if name in _RESERVED:
            continue
        if isinstance(value, (str, numbers.Real)) and not isinstance(value, bool):
            out[name] = value
        elif hasattr(value, "numel") and callable(value.numel) and value.numel() == 1:
            out[name] = value.detach() if hasattr(value, "detach") else value
    return out


def finite_int(value: Any) -> Optional[int]:
    """``value`` as an int when it is a finite number (a framework says "no limit" with inf, -1)."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return int(number) if math.isfinite(number) and number >= 0 else None


def epoch_of(epoch: Any, epochs: Optional[int]) -> Optional[int]:
    """The epoch to show, counted from 0: a framework's count once training ended is one past the
    last epoch (Lightning's ``current_epoch`` becomes ``max_epochs``)."""
    number = finite_int(epoch)
    if number is None:
        return None
    return min(number, epochs - 1) if epochs else number


def stop_agreed() -> bool:
    """Whether any rank saw the run's Stop (one tiny all_reduce, so every rank leaves the
    framework's loop at the same step); False outside a worker."""
    ctx = current_context()
    return ctx is not None and ctx.stop_agreed()


def patch_init(cls: type, after: Optional[Callable[[Any], None]],
               before: Optional[Callable[[dict[str, Any]], dict[str, Any]]] = None) -> None:
    """Call ``after(instance)`` at the end of every ``cls(...)`` made in a worker, when progress is
    on, and have ``before(kwargs)`` change its keyword arguments first (once per class,
    whatever imports it)."""
    if cls.__dict__.get(_MARK):
        return
    original = cls.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        in_worker = current_context() is not None
        original(self, *args, **(before(kwargs) if before is not None and in_worker else kwargs))
        if after is not None and in_worker and enabled():
            guarded(after, self)

    __init__.__wrapped__ = original  # type: ignore[attr-defined]
    __init__.__doc__ = original.__doc__
    cls.__init__ = __init__  # type: ignore[misc]
    setattr(cls, _MARK, True)


def wrap_method(cls: type, name: str, after: Callable[..., None]) -> None:
    """Call ``after(instance, result, *args, **kwargs)`` after every call of ``cls.name``."""
    original = cls.__dict__.get(name)
    if original is None or getattr(original, _MARK, False):
        return

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        if enabled() and current_context() is not None:
            guarded(after, self, result, *args, **kwargs)
        return result

    method.__wrapped__ = original  # type: ignore[attr-defined]
    method.__doc__ = original.__doc__
    method.__name__ = name
    setattr(method, _MARK, True)
    setattr(cls, name, method)


def guarded(report: Callable[..., None], *args: Any, **kwargs: Any) -> None:
    """Run a reporter; a failure of ours is said once on stderr and never breaks the user's training."""
    global _failed
    try:
        report(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - progress is a nicety, the training is not
        if not _failed:
            _failed = True
            print(f"ddp_notebook: live progress from the framework stopped ({type(exc).__name__}: {exc}); "
                  f"the training goes on. Set {SWITCH_ENV}=0 to turn it off.", file=sys.stderr)
