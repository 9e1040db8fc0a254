"""Putting runs and reports on screen: the widget panel in a notebook, text elsewhere;
and starting what ``%ddp_fit`` names (a training function or a dict of fit() arguments)."""
from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

from .textview import format_run
from .validation import ValidationReport

__all__ = ["in_notebook", "show_run", "show_report", "start_target"]


def in_notebook() -> bool:
    """True inside a Jupyter kernel with ipywidgets available (False in terminal IPython, scripts)."""
    try:
        from IPython import get_ipython

        import ipywidgets  # noqa: F401
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def show_run(run: Any, launcher: Optional[Callable[[list[str]], Any]] = None) -> Any:
    """Display the live panel of ``run`` in a notebook; print its state as text elsewhere."""
    if in_notebook():
        from IPython.display import display

        from .panel import DDPPanel

        panel = DDPPanel.for_run(run, launcher=launcher)
        display(panel)
        return panel
    print(format_run(run.state))
    return None


def show_report(report: ValidationReport) -> None:
    """A validation report: a table with red errors in a notebook, text elsewhere."""
    if not in_notebook():
        print(report)
        return
    from IPython.display import display

    from .html import report_html

    class _Report:
        def _repr_html_(self) -> str:
            return report_html(report)

        def __repr__(self) -> str:
            return str(report)

    display(_Report())


def start_target(target: Any, name: str, devices: Optional[str], options: dict) -> tuple[Any, Callable]:
    """Start ``target`` (a function ``fn(ctx, ...)`` or a dict of ``fit`` arguments) without
    waiting; return the run and a function that relaunches it on other devices."""
    from .errors import DDPNotebookError
    from .fit import FitConfigError, fit
    from .launcher import launch

    given = {k: v for k, v in options.items() if v is not None}
    if isinstance(target, dict):
        def start(devs: Any) -> Any:
            kwargs = dict(target)
            kwargs.update({k: v for k, v in given.items()})
            if devs is not None:
                kwargs["devices"] = devs
            try:
                return fit(**kwargs, wait=False)
            except TypeError as e:
                if isinstance(e, DDPNotebookError):  # ours, already in the user's words
                    raise
                raise FitConfigError(f"{name} is not a valid set of fit() arguments: {e}") from None
    elif callable(target):
        params = inspect.signature(target).parameters
        run_kwargs = {}
        for key in ("epochs", "batch_size"):
            if key in given:
                if key not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    raise FitConfigError(f"{name}() takes no {key!r} argument, so --{key.replace('_', '-')} "
                                         "cannot be passed to it")
                run_kwargs[key] = given[key]
        launch_kw = {k: given[k] for k in ("stall_timeout", "engines") if k in given}

        def start(devs: Any) -> Any:
            return launch(target, devices=devs, kwargs=run_kwargs, **launch_kw)
    else:
        raise FitConfigError(f"{name} is a {type(target).__name__}; %ddp_fit takes a training function "
                             "fn(ctx, ...) or a dict of fit() arguments")
    return start(devices), start
