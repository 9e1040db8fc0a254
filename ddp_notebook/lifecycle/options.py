"""Launch options, declared once: what users set (``LaunchOptions``), apart from what a recipe
asks of a run (``RunSettings``).

``launch``, ``fit`` and ``spawn`` take the same options as keyword arguments, typed for checkers
(``**options: Unpack[LaunchKwargs]``) and shown in their signatures and docstrings
(``takes_launch_options``), so ``fit?`` in a notebook lists every one with its default.
"""
from __future__ import annotations

import ast
import inspect
import math
import os
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Optional, TypedDict, TypeVar, Union

from ..core._text import TextEnum
from ..core.errors import ArgumentsError, LaunchOptionError
from ..core.experiment import bounded_config, check_name, check_tags
from ..core.validation import BACKENDS
from ..core.version import __version__
from ..executors.ipyparallel.engines import engines_of
from .trackers import check_report_to, tracker_labels
from .watchdog import auto_floor

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover
    from typing_extensions import Unpack

__all__ = ["LaunchOptions", "LaunchKwargs", "RunSettings", "CallMode", "options_from", "takes_launch_options",
           "Unpack", "check_seconds", "check_option_names", "check_flag", "options_set", "record_of", "MAX_SECONDS",
           "MAX_THREADS", "UI_FORMS", "ui_form"]

MAX_SECONDS = 365 * 24 * 3600  # a year: longer is a typo, and beyond what timers and timedelta take
MAX_THREADS = 1024  # torch threads of one worker, far above any single machine
MAX_RESTARTS = 1000  # a failed run started again at most this many times


@dataclass(frozen=True)
class LaunchOptions:
    """How a run is launched: every option of ``launch``, ``fit`` and ``spawn`` (kept for retries)."""

    backend: Optional[str] = None
    """torch.distributed backend, ``"gloo"`` or ``"nccl"`` (default: nccl for an all-CUDA list, else gloo)."""
    min_free_memory: Optional[int] = None
    """Bytes each worker needs free on its device (host memory for CPU workers); checked before the start."""
    stall_timeout: Union[float, str, None] = "auto"
    """The hang watchdog. ``"auto"``: a rank that stays frozen (same stack, no CPU) while a peer waits
    for it in a collective, after no progress for max(300 s, 20x the usual gap between reports),
    fails the run naming it; slow work never does. Seconds: no progress from any rank for that long
    (from the call of the function) fails the run. None: off."""
    timeout: float = 1800.0
    """Seconds a collective waits for its peers (the process group's timeout, torch's default for gloo)."""
    run_root: Optional[str] = None
    """Where run directories go (default ``$DDP_NOTEBOOK_RUNS``, else ``~/.cache/ddp_notebook/runs``)."""
    threads_per_worker: Optional[int] = None
    """torch threads of each CPU worker (default: the host's cores divided among its workers)."""
    stop_grace: float = 10.0
    """Seconds the workers of a stopped run have to finish before they are interrupted."""
    kill_grace: float = 3.0
    """Seconds an interrupted worker has before it is killed (an engine is only reported)."""
    progress_interval: float = 0.1
    """Seconds between two progress reports of a rank (``ctx.log`` is throttled to this)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables for the workers."""
    engines: Any = field(default=None, compare=False)
    """An ipyparallel ``Client`` or ``DirectView``: one rank per engine instead of local processes."""
    name: Optional[str] = None
    """The run's name, shown in the panel, ``%ddp_runs``, comparisons and trackers; a named run is never
    pruned by the runs folder's limits."""
    tags: dict[str, Any] = field(default_factory=dict)
    """Short labels of the run, ``{"arch": "cnn", "lr": 0.1}`` (keys to short text, numbers or True/False);
    a tagged run is never pruned by the runs folder's limits."""
    report_to: Any = field(default=None, compare=False)
    """Trackers rank 0's logged values go to, from the notebook: ``"tensorboard"``, ``"mlflow"``, ``"wandb"``, a
    list of them, or a tracker object (a ``SummaryWriter``, anything with ``log(metrics, step)``)."""
    max_restarts: int = 0
    """How many times a failed run starts again on the same devices (torch elastic's meaning), each
    attempt a run of its own, from the last checkpoint where there is one; ``wait()`` follows to the
    last attempt. A stopped run is not started again."""
    ui: Optional[str] = None
    """How its views show in a notebook: ``"widget"`` (the live panel), ``"html"`` (its HTML form, kept
    current every second in place: where widgets do not render), ``"text"`` (its text, likewise).
    Default ``$DDP_NOTEBOOK_UI``, else ``"html"`` in Colab (which shows a widget but not what a
    thread changes in it), else the panel, whose HTML form is kept current where no front end
    opens a view of it within 5 s."""

    def __post_init__(self) -> None:
        for name in ("timeout", "stall_timeout", "stop_grace", "kill_grace", "progress_interval"):
            check_seconds(name, getattr(self, name))
        for name, least in (("threads_per_worker", 1), ("min_free_memory", 0)):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < least):
                raise LaunchOptionError(f"{name} must be a whole number >= {least} or None, not {value!r}")
        if isinstance(self.max_restarts, bool) or not isinstance(self.max_restarts, int) or \
                not 0 <= self.max_restarts <= MAX_RESTARTS:
            raise LaunchOptionError(f"max_restarts must be a whole number from 0 to {MAX_RESTARTS}, not "
                                    f"{self.max_restarts!r}")
        if self.threads_per_worker is not None and self.threads_per_worker > MAX_THREADS:
            raise LaunchOptionError(f"threads_per_worker must be at most {MAX_THREADS}, not {self.threads_per_worker}")
        if self.backend is not None and (not isinstance(self.backend, str) or self.backend not in BACKENDS):
            raise LaunchOptionError(f"backend must be {' or '.join(map(repr, BACKENDS))} or None (the default "
                                    f"for the devices), not {self.backend!r}")
        _check_run_root(self.run_root)
        if _is_auto(self.stall_timeout):
            auto_floor()  # a bad $DDP_NOTEBOOK_STALL_FLOOR is said now, before anything starts
        if self.engines is not None:
            object.__setattr__(self, "engines", engines_of(self.engines))
        object.__setattr__(self, "env", _checked_env(self.env))
        object.__setattr__(self, "name", check_name(self.name))
        object.__setattr__(self, "tags", check_tags(self.tags))
        object.__setattr__(self, "report_to", check_report_to(self.report_to))
        ui_form(self.ui)  # a bad $DDP_NOTEBOOK_UI is said now, before anything starts


#: How a run's views may show (``LaunchOptions.ui``).
UI_FORMS = ("widget", "html", "text")


def ui_form(ui: Optional[str]) -> str:
    """The form a run's views take: ``ui``, else ``$DDP_NOTEBOOK_UI``, else ``"html"`` in Colab,
    else ``"auto"`` (the panel, its HTML form kept current where no front end opens a view of it).
    Colab renders the panel but shows nothing a background thread changes in a widget until a
    later cell runs (googlecolab/colabtools#3373): a view opens there, so the panel would look
    live and stand still.

    Raises
    ------
    LaunchOptionError
        ``ui`` or ``$DDP_NOTEBOOK_UI`` is not one of ``UI_FORMS``.
    """
    if ui is not None:
        if not isinstance(ui, str) or ui.strip().lower() not in UI_FORMS:
            raise LaunchOptionError(f"ui must be {', '.join(map(repr, UI_FORMS))} or None (the default), not {ui!r}")
        return ui.strip().lower()
    given = os.environ.get("DDP_NOTEBOOK_UI", "")
    env = given.strip().lower()  # (any case, as device lists take)
    if env and env not in UI_FORMS:
        raise LaunchOptionError(f"$DDP_NOTEBOOK_UI is {given!r}: set it to {', '.join(map(repr, UI_FORMS))}, or unset "
                                "it for the panel")
    return env or ("html" if "google.colab" in sys.modules else "auto")


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


def _check_run_root(value: Any) -> None:
    """``run_root``: None, or a folder's path (text without NUL characters)."""
    path = os.fspath(value) if isinstance(value, os.PathLike) else value
    if value is not None and (not isinstance(path, str) or not path.strip() or "\0" in path):
        raise LaunchOptionError(f"run_root must be the path of a folder (a str) or None (the default), not {value!r}")


def _checked_env(env: Any) -> dict[str, str]:
    """``env``: a mapping of variable names to text, as ``os.environ`` takes them (None: nothing)."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise LaunchOptionError(f"env must be a dict of environment variables, such as {{'OMP_NUM_THREADS': '4'}}, "
                                f"not {env!r}")
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise LaunchOptionError(f"env has the name {key!r}: an environment variable's name is non-empty text "
                                    "without '=' or NUL characters")
        if not isinstance(value, str) or "\0" in value:
            raise LaunchOptionError(f"env[{key!r}] must be text without NUL characters (os.environ holds "
                                    f"strings), not {value!r}")
    return dict(env)


def check_flag(name: str, value: Any) -> None:
    """A yes-or-no argument: True or False, nothing that merely looks true."""
    if not isinstance(value, bool):
        raise LaunchOptionError(f"{name} must be True or False, not {value!r}")


def check_seconds(name: str, value: Any, *, positive: Optional[bool] = None, optional: bool = False) -> None:
    """A duration: finite seconds up to ``MAX_SECONDS``; by default ``timeout`` and
    ``stall_timeout`` (which may also be None or ``"auto"``) > 0, the others >= 0. ``optional``:
    None is allowed too."""
    auto = name == "stall_timeout"
    if (auto and _is_auto(value)) or ((auto or optional) and value is None):
        return
    positive = name in ("timeout", "stall_timeout") if positive is None else positive
    number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not number or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        also = ", 'auto' or None" if auto else " or None" if optional else ""
        raise LaunchOptionError(f"{name} must be a number of seconds {bound}{also}, not {value!r}")
    if value > MAX_SECONDS:
        raise LaunchOptionError(f"{name} must be at most {MAX_SECONDS} seconds (a year), not {value!r}")


class LaunchKwargs(TypedDict, total=False):
    """``LaunchOptions`` as keyword arguments (``**options: Unpack[LaunchKwargs]``); a unit test
    keeps the two alike."""

    backend: Optional[str]
    min_free_memory: Optional[int]
    stall_timeout: Union[float, str, None]
    timeout: float
    run_root: Optional[str]
    threads_per_worker: Optional[int]
    stop_grace: float
    kill_grace: float
    progress_interval: float
    env: dict[str, str]
    engines: Any
    name: Optional[str]
    tags: dict[str, Any]
    report_to: Any
    max_restarts: int
    ui: Optional[str]


class CallMode(TextEnum):
    CONTEXT = "context"  # fn(ctx, *args, **kwargs) in a process group set up for it
    SPAWN = "spawn"  # fn(rank, *args) sets up its own process group (torch.multiprocessing.spawn style)
    SESSION = "session"  # the rank serves a session's requests (worker.session_loop), its call's args its loop's


@dataclass(frozen=True)
class RunSettings:
    """What a recipe asks of a run beyond the user's options (never set by users)."""

    mode: CallMode = CallMode.CONTEXT
    resume_from: Optional[str] = None  # the checkpoint file ctx.load_checkpoint() reads
    # Turns the main worker's return value into what wait() gives back (fit's FitResult);
    # stays in the notebook, never sent to the workers.
    postprocess: Optional[Callable[[Any, Any], Any]] = field(default=None, compare=False)
    # Print what the ranks print in the notebook as it comes, each line marked ``[rank1]:``, as
    # torch.multiprocessing's children print to it (spawn); otherwise it is in run.output().
    echo: bool = False
    # What the run is, for its record (core.experiment): what started it, the call's arguments by
    # parameter name (summarized), a fingerprint of its code, the value whose best it records and
    # whether lower is better.
    origin: str = "launch"
    config: dict[str, Any] = field(default_factory=dict, compare=False)
    code: Optional[str] = None
    monitor: Optional[str] = None
    monitor_mode: str = "min"
    # An Optuna trial the monitored value is reported to, which may prune the run; notebook-only:
    # never kept on disk, never passed on to a retry.
    trial: Any = field(default=None, compare=False)
    # A session's run: where its ranks' answers go (rank, event, attachment), from the thread
    # that supervises the run (``lifecycle.session``); never passed on to a retry.
    answers: Optional[Callable[[int, dict[str, Any], Any], None]] = field(default=None, compare=False)

    def kept(self) -> RunSettings:
        """These settings as a run keeps them for a retry: without the trial or a session's answers."""
        return replace(self, trial=None, answers=None)


# The options a run's config records when set (core.experiment): the others say where and how it
# is shown or kept (run_root, name, tags, report_to, ui), are objects (engines), or may hold secrets (env).
NOT_IN_CONFIG = frozenset({"run_root", "name", "tags", "report_to", "engines", "env", "ui"})


def record_of(options: LaunchOptions, settings: RunSettings, devices: Sequence[Any]) -> dict[str, Any]:
    """What a run is, for its ``run_started`` event (``core.experiment``): its name, tags and config
    (the call's arguments, its devices, the options set; an option named as an argument is
    ``option.<name>``), what started it, where, the value it monitors, a fingerprint of its code,
    the versions known at the start (torch's comes from rank 0, git's after the start) and the
    trackers it reports to."""
    config = bounded_config({**settings.config, "devices": ",".join(map(str, devices)),
                             **{k if k not in settings.config else f"option.{k}": v
                                for k, v in options_set(options).items()}})
    return {"name": options.name, "tags": options.tags, "config": config, "origin": settings.origin,
            "cwd": os.getcwd(), "monitor": settings.monitor, "monitor_mode": settings.monitor_mode,
            "code": settings.code, "versions": {"python": sys.version.split()[0], "ddp_notebook": __version__},
            "report_to": tracker_labels(options.report_to)}


def options_set(options: LaunchOptions) -> dict[str, Any]:
    """The launch options that differ from their defaults, as a run's config records them (env by
    its variables' names only: values may be secrets)."""
    out: dict[str, Any] = {}
    for f in fields(LaunchOptions):
        default = f.default if f.default_factory is MISSING else f.default_factory()
        value = getattr(options, f.name)
        if f.name not in NOT_IN_CONFIG and value != default:
            out[f.name] = value
    if options.env:
        out["env"] = sorted(options.env)
    return out


OPTION_NAMES = frozenset(f.name for f in fields(LaunchOptions))


def check_option_names(caller: str, given: dict[str, Any]) -> None:
    """Refuse keyword arguments that are not launch options, in the caller's words."""
    unknown = sorted(set(given) - OPTION_NAMES)
    if unknown:
        raise ArgumentsError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                             f"launch options are {', '.join(sorted(OPTION_NAMES))}")


def options_from(caller: str, given: dict[str, Any]) -> LaunchOptions:
    """``LaunchOptions`` from keyword arguments, refusing unknown names in the caller's words."""
    check_option_names(caller, given)
    return LaunchOptions(**given)


def _attribute_docs(cls: type) -> dict[str, str]:
    """The docstring under each annotated attribute of ``cls`` (as Sphinx reads them)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0]
    assert isinstance(tree, ast.ClassDef)
    return {a.target.id: str(b.value.value) for a, b in zip(tree.body, tree.body[1:])
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name)
            and isinstance(b, ast.Expr) and isinstance(b.value, ast.Constant)}


def _options_doc() -> str:
    """The launch options as a numpydoc ``Other Parameters`` section (indented for a docstring)."""
    docs = _attribute_docs(LaunchOptions)
    lines = ["", "    Other Parameters", "    ----------------"]
    for f in fields(LaunchOptions):
        default = f.default if f.default_factory is MISSING else f.default_factory()
        lines.append(f"    {f.name} : {f.type}, default {default!r}")
        text = " ".join(line.strip() for line in docs[f.name].splitlines())
        lines += ["        " + line for line in textwrap.wrap(text, 92)]
    return "\n".join(lines) + "\n"


F = TypeVar("F", bound=Callable[..., Any])


def takes_launch_options(fn: F) -> F:
    """Show the launch options in ``fn``'s signature and docstring (``fn`` takes them as
    ``**options``): what ``help()``, IPython's ``?`` and completion read."""
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    for f in fields(LaunchOptions):
        default = f.default if f.default_factory is MISSING else f.default_factory()
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=f.type))
    fn.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
    fn.__doc__ = (fn.__doc__ or "").rstrip() + "\n" + _options_doc()
    return fn
