"""IPython magics: ``%load_ext ddp_notebook``, then ``%ddp_devices``, ``%ddp_fit``, ``%ddp_status``,
``%ddp_stop``, ``%ddp_retry``, ``%ddp_runs``, ``%ddp_compare``, ``%ddp_debug``. Each parses its
arguments and calls the Python API; the extension's load and unload live here too."""
from __future__ import annotations

import argparse
import ast
import difflib
import inspect
import math
import os
import re
import shlex
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..core.devices import ALIASES, KINDS
from ..core.errors import (
    ArgumentsError,
    DDPNotebookError,
    DeviceSpecError,
    EngineSelectionError,
    EngineUnavailableError,
    FitConfigError,
    LaunchOptionError,
    NoCheckpointError,
    NotPicklableError,
    RunLoadError,
    UnsafeRunDirError,
)
from ..core.failures import WorkerFailure, format_locals
from ..core.rundir import KEEP_RUNS_ENV, RUNS_MAX_BYTES_ENV, RunDir, default_run_root, folder_bytes, runs_limits
from ..core.tracebacks import file_name
from ..core.validation import InvalidDevicesError, validate_devices
from ..lifecycle.experiments import find_runs, runs_of_here
from ..lifecycle.launch import (
    default_devices,
    find_run,
    last_run,
    launch,
    prune_runs,
    set_default_devices,
    start_fork_server,
    stop_fork_server,
)
from ..lifecycle.options import MAX_SECONDS, UI_FORMS
from ..lifecycle.run import Run
from ..lifecycle.stored import read_summary, stored_runs
from ..recipes.fit import fit
from . import display
from .comparison import compare
from .display import show_report, show_run
from .text import format_bytes, format_run, format_runs, request_text

__all__ = ["DDPMagics", "load_ipython_extension", "unload_ipython_extension", "start_target"]

_USER_MISTAKES = (DeviceSpecError, InvalidDevicesError, NotPicklableError, FitConfigError, NoCheckpointError,
                  EngineSelectionError, EngineUnavailableError, LaunchOptionError, ArgumentsError)


def _parse(magic: Any, line: str, shown: Optional[str] = None) -> argparse.Namespace:
    """A magic's arguments, read as a shell would: quotes group words, and a ``#`` outside quotes
    starts a comment that is not an argument (``%ddp_devices cpu*2  # two workers``)."""
    name = shown or f"%{magic.__name__}"  # "%%ddp" for a cell magic
    try:
        words = shlex.split(line, comments=True)
    except ValueError as e:  # "No closing quotation"
        raise UsageError(f"{name}: cannot read {line.strip()!r}: {str(e).lower()}") from None
    options = _option_names(magic.parser)
    words = _devices_joined(words, options)
    try:
        args, extra = magic.parser.parse_known_args(words)
    except UsageError as e:  # argparse's own message, said by the magic like every other
        # An unknown option first: it is the mistake ("--bogus"), not the argument it hid.
        unknown = [w for w in words if w.startswith("-") and len(w) > 1 and not _number(w)
                   and w.split("=")[0] not in options]
        if not unknown:
            raise UsageError(f"{name}: {e}{_device_typo(words, options)}") from None
        extra = unknown
    if extra:
        close = [match for word in extra if word.startswith("-")
                 for match in difflib.get_close_matches(word.split("=")[0], options, n=1)]
        hint = f" (did you mean {close[0]}?)" if close else _device_typo(words, options)
        raise UsageError(f"{name}: unrecognized arguments: {' '.join(extra)}{hint}; {name}? lists them")
    return args


_KINDS = "|".join((*KINDS, *ALIASES))  # cpu|cuda|gpu: the device kinds validation knows
#: A word meant as a device, mistyped (``cpu1``, ``cuda 0``): named in an error, never joined.
_LIKE_A_DEVICE = re.compile(rf"(?i:{_KINDS})(?![A-Za-z_])")


def _device_typo(words: list[str], options: Sequence[str]) -> str:
    """What ``-d`` took where that explains an error: a word after its list that looks like a
    mistyped device (``-d cpu:0 cpu1 train``), or a value that is no device (``-d train``)."""
    for i, word in enumerate(words[:-1]):
        if not _is_devices_option(word, options):
            continue
        value, after = words[i + 1], words[i + 2] if i + 2 < len(words) else ""
        if not _LIKE_A_DEVICE.match(value):
            return f" (-d took {value!r} as its device list: give the devices after -d, -d cpu*2 {value})"
        if _LIKE_A_DEVICE.match(after):
            return (f" (-d took {value!r} as its device list and {after!r} as what follows it: write "
                    "devices as cpu:1 or cpu*2, a list with commas: -d cpu:0,cpu:1)")
    return ""


def _number(word: str) -> bool:
    """Whether ``word`` reads as a number (``-1``, ``-0.5``): an argument, not an option."""
    try:
        float(word)
    except ValueError:
        return False
    return True


def _lookup(name: str, ns: dict[str, Any]) -> Any:
    """The object that ``name`` (``train`` or ``helpers.train``) names in the notebook's namespace,
    attribute by attribute, never evaluated; ``KeyError`` naming the part that is missing."""
    first, *rest = name.split(".")
    if first not in ns:
        raise KeyError(first)
    value = ns[first]
    for i, attr in enumerate(rest):
        if not attr.isidentifier() or not hasattr(value, attr):
            raise KeyError(".".join([first, *rest[: i + 1]]))
        value = getattr(value, attr)
    return value


def _engines_named(text: str, ns: dict[str, Any]) -> Any:
    """What ``--engines`` names: a Client or view in the notebook (``rc``), or a view of it by
    whole-number indices or a slice (``rc[0:2]``, ``rc[::2]``), read, never evaluated;
    ``KeyError`` naming what is not there."""
    try:
        node = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise KeyError(text) from None
    if not isinstance(node, ast.Subscript):
        return _lookup(text.strip(), ns)
    base = _dotted(node.value)
    if base is None:
        raise KeyError(text)

    def number(part: Optional[ast.expr]) -> Optional[int]:
        try:
            value = ast.literal_eval(part) if part is not None else None
        except ValueError:
            raise KeyError(text) from None
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise KeyError(text)
        return value

    part = node.slice
    key = slice(number(part.lower), number(part.upper), number(part.step)) if isinstance(part, ast.Slice) \
        else number(part)
    return _lookup(base, ns)[key]


def _dotted(node: ast.expr) -> Optional[str]:
    """``a.b.c`` for a chain of names and attributes, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return f"{head}.{node.attr}" if head is not None else None
    return None


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    """The options a magic's parser takes (``-d``, ``--devices``...), read from its public help:
    the lines that list them start with a dash."""
    lines = [line.strip() for line in parser.format_help().splitlines()]
    return [word.rstrip(",") for line in lines if line.startswith("-") for word in line.split()
            if re.fullmatch(r"--?[a-z][\w-]*,?", word)]


def _seconds(text: str, positive: bool) -> Optional[float]:
    """``text`` as finite seconds (> 0 when ``positive``, else >= 0) up to ``MAX_SECONDS``, or None."""
    try:
        value = float(text) if text.isascii() else math.nan  # "٣" is not 3 here either
    except ValueError:
        return None
    ok = math.isfinite(value) and (value > 0 if positive else value >= 0) and value <= MAX_SECONDS
    return value if ok else None


def _stall_setting(text: str) -> Any:
    """``--stall-timeout``: seconds, ``auto`` or ``off``."""
    if text.lower() in ("auto", "off"):
        return text.lower()
    value = _seconds(text, positive=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds, 'auto' or 'off' (seconds: > 0, "
                                         f"at most {MAX_SECONDS})")
    return value


def _grace(text: str) -> float:
    """``--grace``: seconds >= 0."""
    value = _seconds(text, positive=False)
    if value is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds (>= 0, at most {MAX_SECONDS})")
    return value


def _at_least_one(text: str) -> int:
    """``--epochs``, ``--batch-size``: a whole number >= 1."""
    value = int(text) if re.fullmatch(r"[0-9]{1,18}", text.strip()) else 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 1 (of at most 18 digits)")
    return value


def _tag(text: str) -> tuple[str, Any]:
    """``--tag KEY=VALUE``: the value a number when it reads as one, True/False (in any case:
    ``debug=true`` too, as a command line writes it), else text."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE (such as arch=cnn or lr=0.1)")
    if value.strip().lower() in ("true", "false"):
        return key.strip(), value.strip().lower() == "true"
    try:
        parsed: Any = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        parsed = value.strip()
    if isinstance(parsed, (list, tuple, dict, set, complex, bytes)) or parsed is None:
        parsed = value.strip()
    return key.strip(), parsed


_CALL = re.compile(r"\s*[A-Za-z_][A-Za-z0-9_]*(\s*\.\s*[A-Za-z_][A-Za-z0-9_]*)*\s*\(")


def _split_call(line: str, ns: dict[str, Any]) -> tuple[str, tuple[Any, ...], dict[str, Any], str]:
    """``train(100, lr=0.1) --epochs 3`` -> ("train", (100,), {"lr": 0.1}, "--epochs 3"), the
    options before the call or after it. The call is read with ``ast``, never evaluated: each
    argument is a literal or a name defined in ``ns``. A line without a call comes back whole,
    with no arguments."""
    # Where a call may start: the line's first word, or a word after the options (never inside one).
    starts = [m.start() for m in re.finditer(r"(?:^|(?<=\s))[A-Za-z_]", line) if _CALL.match(line, m.start())]
    if not starts:
        return "", (), {}, line
    call = None
    for start in starts:
        for end in (i for i, ch in enumerate(line) if ch == ")" and i > start):
            try:
                tree = ast.parse(line[start: end + 1].strip(), mode="eval")
            except (SyntaxError, ValueError):  # ValueError: a NUL character (Python < 3.12)
                continue
            if isinstance(tree.body, ast.Call) and _dotted(tree.body.func) is not None:
                call, rest = tree.body, f"{line[:start]} {line[end + 1:]}"
                break
        if call is not None:
            break
    if call is None:
        raise UsageError(f"%ddp_fit: cannot read the call in {line.strip()!r}: write it as Python, "
                         "e.g. train(100, lr=0.1)")
    func = _dotted(call.func)
    assert func is not None

    def value(node: ast.expr) -> Any:
        name = _dotted(node)
        if name is not None:
            try:
                return _lookup(name, ns)
            except KeyError as e:
                raise UsageError(f"%ddp_fit: there is no {e.args[0]!r} in the notebook for the call") from None
        try:
            return ast.literal_eval(node)
        except (ValueError, TypeError, RecursionError):  # TypeError: {[1]: 2}, a key that cannot be one
            raise UsageError(f"%ddp_fit: an argument of the call is a literal (100, 0.1, 'adam', [1, 2]) or a name "
                             f"defined in the notebook, not {ast.unparse(node)}; assign it to a name first") from None

    if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
        raise UsageError("%ddp_fit: *args and **kwargs are not read in the call; name each argument")
    named = [k.arg for k in call.keywords]
    twice = next((k for k in named if named.count(k) > 1), None)
    if twice is not None:  # (Python's compiler refuses it; ast.parse does not)
        raise UsageError(f"%ddp_fit: the call gives {twice}= twice ({ast.unparse(call)}); give each argument once")
    kwargs = {k.arg: value(k.value) for k in call.keywords if k.arg is not None}
    return func, tuple(value(a) for a in call.args), kwargs, rest


# cpu:1, cuda:0-3, cpu*2, or a kind alone (cpu, CUDA, gpu): never a function's name or an option
_DEVICE_WORD = re.compile(rf"[A-Za-z]+[:*]|(?i:{_KINDS})$")


def _is_devices_option(word: str, options: Sequence[str]) -> bool:
    """``-d``, ``--devices`` or an abbreviation argparse takes for it (``--dev``: the start of no
    other of the magic's ``options``)."""
    if word in ("-d", "--devices"):
        return True
    return len(word) > 2 and [o for o in options if o.startswith(word)] == ["--devices"]


def _devices_joined(words: list[str], options: Sequence[str] = ("-d", "--devices")) -> list[str]:
    """``-d cpu:0, cpu:1`` (or ``-d cpu:0 cpu:1``) as one argument, ``-d cpu:0,cpu:1``: ``-d``
    takes one word, so that a function named after it is the function, and a list written with
    spaces is still one list.

    >>> _devices_joined(["-d", "cpu:0,", "cpu:1", "cpu", "train"])
    ['-d', 'cpu:0,cpu:1,cpu', 'train']
    >>> _devices_joined(["--dev", "cpu:0,", "train"])  # a comma before the function ends the list
    ['--dev', 'cpu:0,', 'train']
    """
    out: list[str] = []
    value = False  # the last word is the value of -d / --devices
    for word in words:
        joined = _next_device(out[-1], word) if value else None
        if joined is not None:
            out[-1] = joined
            continue
        out.append(word)
        value = (len(out) > 1 and _is_devices_option(out[-2], options)) or \
            ("=" in word and _is_devices_option(word.split("=")[0], options))
    return out


def _next_device(spec: str, word: str) -> Optional[str]:
    """``spec`` with ``word`` added when the word is a device (``cpu:1``, ``cuda``) or begins
    with a comma; None when it is not part of the list."""
    if word.startswith(","):
        return spec + word
    if not _DEVICE_WORD.match(word):
        return None
    return spec + word if spec.endswith(",") else f"{spec},{word}"


def _device_list(words: Optional[list[str]]) -> Optional[str]:
    """Device-list words as one spec: every word is a device, so ``cpu:0, cpu:1`` and
    ``cpu:0 cpu:1`` both mean ``cpu:0,cpu:1``, and a word that is no device is named alone.

    >>> _device_list(["cpu:0", "cpu:1"]), _device_list(["cpu:0,", "cpu:1"]), _device_list(["cpu:0", "cpu1"])
    ('cpu:0,cpu:1', 'cpu:0,cpu:1', 'cpu:0,cpu1')
    """
    if not words:
        return None
    spec = words[0]
    for word in words[1:]:
        spec += word if spec.endswith(",") or word.startswith(",") else f",{word}"
    return spec


def _run(magic: str, run_id: Optional[str]) -> Run:
    """The run a magic acts on: ``run_id`` (or the end of it), else this kernel's last run."""
    if run_id is None:
        run = last_run()
        if run is None:
            raise UsageError(f"%{magic}: no run yet: start one with %ddp_fit FUNC (or a session: %ddp_session)")
        return run
    found = find_run(run_id)
    if found is not None:
        return found
    try:
        listed = find_runs([run_id])[0]  # a run of an earlier kernel (before a restart)
        return listed.run if listed.run is not None else Run.load(listed.path)
    except (RunLoadError, UnsafeRunDirError, ArgumentsError) as e:
        hint = f" ({run_id!r} reads as a device, not a run: -d takes a device list, -d cpu:0,cpu:1)" \
            if _LIKE_A_DEVICE.match(run_id) else ""
        raise UsageError(f"%{magic}: {e}{hint}") from None


def start_target(target: Any, name: str, devices: Optional[str], options: dict[str, Any], args: tuple[Any, ...] = (),
                 kwargs: Optional[dict[str, Any]] = None) -> tuple[Run, Callable[[Any], Run]]:
    """Start what ``%ddp_fit`` names (a function ``fn(ctx, ...)``, called with ``args`` and
    ``kwargs``, or a dict of ``fit`` arguments) without waiting; return the run and a function
    that relaunches it on other devices."""
    given = {k: v for k, v in options.items() if v is not None}
    if given.get("stall_timeout") == "off":
        given["stall_timeout"] = None
    if isinstance(target, dict) and (args or kwargs):
        raise FitConfigError(f"{name} is a dict of fit() arguments, not a function to call")
    if isinstance(target, dict):
        def start(devs: Any) -> Run:
            kwargs = dict(target)
            kwargs.update(given)
            if devs is not None:
                kwargs["devices"] = devs
            try:
                run = fit(**kwargs, wait=False)
            except TypeError as e:
                if isinstance(e, DDPNotebookError):  # ours, already in the user's words
                    raise
                raise FitConfigError(f"{name} is not a valid set of fit() arguments: {e}") from None
            assert isinstance(run, Run)
            return run
    elif callable(target):
        try:
            params = inspect.signature(target).parameters
        except (ValueError, TypeError):  # a builtin without a signature
            raise FitConfigError(f"{name} is a {type(target).__name__} whose arguments cannot be read; %ddp_fit "
                                 "takes a training function fn(ctx, ...) or a dict of fit() arguments") from None
        run_kwargs: dict[str, Any] = dict(kwargs or {})
        for key in ("epochs", "batch_size"):
            if key in given:
                if key not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    raise FitConfigError(f"{name}() takes no {key!r} argument, so --{key.replace('_', '-')} "
                                         "cannot be passed to it")
                run_kwargs[key] = given[key]
        launch_kw = {k: given[k] for k in ("stall_timeout", "engines", "name", "tags", "report_to", "ui") if k in given}

        def start(devs: Any) -> Run:
            return launch(target, devices=devs, args=args, kwargs=run_kwargs, **launch_kw)
    else:
        raise FitConfigError(f"{name} is a {type(target).__name__}; %ddp_fit takes a training function "
                             "fn(ctx, ...) or a dict of fit() arguments")
    return start(devices), start


RUNS_SHOWN = 20
"""Runs that ``%ddp_runs`` lists (the newest; ``-n N`` lists N)."""


def _list_runs(everywhere: bool, shown: int) -> None:
    """The runs launched from this working directory (every run on disk with ``everywhere``),
    newest first, a retry under the run it retries: one row each."""
    root, here = default_run_root(), os.getcwd()
    found = runs_of_here(everywhere)[::-1]
    if not found:
        print(f"No run on disk in {root}: start one with %ddp_fit FUNC." if everywhere else
              f"No run launched from {here} yet: start one with %ddp_fit FUNC. %ddp_runs --all lists every "
              "notebook's runs.")
        return
    total = sum(folder_bytes(r.path) for r in found)
    where = f"in {root}" if everywhere else f"launched from {here}"
    also = "" if everywhere else " (%ddp_runs --all: every notebook's)"
    print(f"Runs {where}, newest first: {_count(len(found), 'run')}, {format_bytes(total)}{also}")
    states, unreadable = [], []
    for listed in found[:shown]:
        try:
            states.append(listed.run.state if listed.run is not None else read_summary(RunDir(listed.path)))
        except (RunLoadError, UnsafeRunDirError) as e:
            unreadable.append(f"  {listed.id}  cannot be read: {e}")
    current = last_run()
    for line in format_runs(states, current=current.id if current is not None else None):
        print(line)
    for line in unreadable:
        print(line)
    if len(found) > shown:
        more = " --all" if everywhere else ""
        print(f"  ... and {len(found) - shown} older: %ddp_runs{more} -n {len(found)} lists them all")


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'' if n == 1 else 's'}"


def _clean_runs() -> None:
    """Prune the runs folder now, saying what went and what is left."""
    root = default_run_root()
    try:
        keep, max_bytes = runs_limits()
        removed = prune_runs(root)
    except (LaunchOptionError, UnsafeRunDirError, OSError) as e:
        raise UsageError(f"%ddp_runs: {e}") from None
    left = stored_runs(root)
    limits = (f"at most {_count(keep, 'run') if keep is not None else 'any number of runs'} and "
              f"{format_bytes(max_bytes) if max_bytes is not None else 'any size'}: ${KEEP_RUNS_ENV}, "
              f"${RUNS_MAX_BYTES_ENV}")
    gone = (f"Removed {_count(len(removed), 'finished run')} ({format_bytes(sum(r.size for r in removed))})"
            if removed else "Nothing to remove")
    print(f"{gone} from {root}; {_count(len(left), 'run')} ({format_bytes(sum(folder_bytes(d.path) for d in left))}) "
          f"left ({limits}; runs still going, those they read and this kernel's are kept).")


@magics_class
class DDPMagics(Magics):
    @property
    def user_ns(self) -> dict[str, Any]:
        assert self.shell is not None
        return self.shell.user_ns

    @magic_arguments()
    @argument("spec", nargs="*", help="device list to validate and make the default, e.g. cpu*2 or cuda:0,cuda:1")
    @line_magic
    def ddp_devices(self, line: str) -> None:
        """Show, validate and set the default device list of this kernel."""
        spec = _device_list(_parse(self.ddp_devices, line).spec)
        report = validate_devices(spec or default_devices())
        if spec and report.ok:
            set_default_devices(spec)
        show_report(report)
        if spec and not report.ok:
            print(f"The default device list stays {default_devices()!r}: runs without --devices use it.")

    @magic_arguments()
    @argument("func", help="a training function fn(ctx, ...) or a dict of fit() arguments, by name; a function may "
                           "be called: train(100, lr=0.1), each argument a literal or a name in the notebook")
    @argument("-d", "--devices", help="device list (default: the one set with %%ddp_devices)")
    @argument("--epochs", type=_at_least_one, metavar="N", help="number of epochs (passed to the function as epochs=N)")
    @argument("--batch-size", type=_at_least_one, metavar="N", help="batch size per worker (fit configurations)")
    @argument("--stall-timeout", type=_stall_setting, metavar="SECONDS|auto|off",
              help="the hang watchdog: fail the run when no rank reports progress for SECONDS; auto (the "
                   "default) fails only a rank that is frozen while its peers wait for it; off")
    @argument("--engines", help="run one rank per ipyparallel engine: the name of a Client or DirectView")
    @argument("--name", help="the run's name (shown in the panel, %%ddp_runs and comparisons; kept from pruning)")
    @argument("--tag", action="append", type=_tag, metavar="KEY=VALUE", default=[],
              help="a tag of the run (again for more: --tag arch=cnn --tag lr=0.1)")
    @argument("--report-to", metavar="TRACKER[,TRACKER]", help="send rank 0's logged values to trackers: "
                                                                "tensorboard, mlflow, wandb (comma-separated)")
    @argument("--ui", choices=UI_FORMS, type=str.lower,
              help="how the run shows: widget (the panel), html or text (kept current "
                   "in place, where widgets do not render); default $DDP_NOTEBOOK_UI, "
                   "else the panel (html in Colab)")
    @argument("--wait", action="store_true", help="block until the run ends and return its result")
    @line_magic
    def ddp_fit(self, line: str) -> Any:
        """Launch a DDP run in background workers and show its live panel; returns at once."""
        func, call_args, call_kwargs, rest = _split_call(line, self.user_ns)
        args = _parse(self.ddp_fit, f"{func} {rest}" if func else rest)
        found = {}
        for name, what, find in ((args.func, "a training function fn(ctx) or a dict of fit() arguments", _lookup),
                                 (args.engines, "an ipyparallel Client or DirectView", _engines_named)):
            if name is not None:
                try:
                    found[name] = find(name, self.user_ns)
                except KeyError as e:
                    raise UsageError(f"%ddp_fit: there is no {e.args[0]!r} in the notebook; define {what} with "
                                     "that name first") from None
        twice = next((key for i, (key, _) in enumerate(args.tag) if key in dict(args.tag[:i])), None)
        if twice is not None:
            raise UsageError(f"%ddp_fit: --tag {twice}= is given twice; a tag has one value")
        options = {"epochs": args.epochs, "batch_size": args.batch_size, "stall_timeout": args.stall_timeout,
                   "engines": found[args.engines] if args.engines else None, "name": args.name,
                   "tags": dict(args.tag) or None,
                   "report_to": [t for t in args.report_to.split(",") if t.strip()] if args.report_to else None,
                   "ui": args.ui}
        try:
            run, relaunch = start_target(found[args.func], args.func, args.devices, options,
                                         call_args, call_kwargs)
        except _USER_MISTAKES as e:
            raise UsageError(f"%ddp_fit: {e}") from None
        self._started(run)
        show_run(run, launcher=relaunch, on_start=self._started)
        if args.wait:
            return run.wait()

    def _started(self, run: Run) -> None:
        # `_ddp_run` is this kernel's last run, wherever it was started (a magic, the panel).
        self.user_ns["_ddp_run"] = run

    @magic_arguments()
    @argument("run", nargs="?", help="a run id, or its end (default: the last run)")
    @line_magic
    def ddp_status(self, line: str) -> None:
        """Print the state of the last run (or of RUN)."""
        print(format_run(_run("ddp_status", _parse(self.ddp_status, line).run).state))

    @magic_arguments()
    @argument("--all", action="store_true", help="list every run on disk, whichever notebook launched it")
    @argument("-n", type=_at_least_one, metavar="N", help=f"list the last N runs (default {RUNS_SHOWN})")
    @argument("--clean", action="store_true", help="remove the oldest finished runs now, down to the limits "
                                                   f"(${KEEP_RUNS_ENV}, ${RUNS_MAX_BYTES_ENV}); named, tagged "
                                                   "and pinned runs are kept")
    @line_magic
    def ddp_runs(self, line: str) -> None:
        """List the runs launched from this notebook's working directory, this kernel's and earlier
        kernels' (after a restart, how a run is found and why it ended), newest first: per run its
        id, name, status, devices, start and length, the config that sets it apart from the others
        listed, its monitored metric, why it ended; a retry under the run it retries, a session with
        its cells; the current run (``_ddp_run``) marked with *. With --all, every notebook's runs;
        with --clean, remove the oldest finished runs down to the runs folder's limits first."""
        args = _parse(self.ddp_runs, line)
        if args.clean:
            _clean_runs()
            if not args.all and args.n is None:
                return
        _list_runs(args.all, args.n or RUNS_SHOWN)

    @magic_arguments()
    @argument("runs", nargs="*", metavar="RUN", help="run ids or their ends (default: the runs launched from this "
                                                     "notebook's working directory)")
    @argument("--last", type=_at_least_one, metavar="N", help="only the last N runs")
    @argument("--metric", action="append", metavar="M", help="a metric to plot (again for more; default: the "
                                                             "losses and metrics logged)")
    @argument("--all", action="store_true", help="without RUN: every run on disk, whichever notebook launched it")
    @argument("--ui", choices=UI_FORMS, type=str.lower,
              help="how it shows: html (curves and table; widget is the same) or text "
                   "(the table as text)")
    @line_magic
    def ddp_compare(self, line: str) -> Any:
        """Compare runs: their curves overlaid (one plot per metric), then a table of what differs
        between them (config, final and best metrics); live while a run goes on. Returns the
        ``Comparison`` (``.frame()``: a pandas DataFrame)."""
        args = _parse(self.ddp_compare, line)
        try:
            return compare(*args.runs, metrics=args.metric, last=args.last, everywhere=args.all, ui=args.ui)
        except (RunLoadError, UnsafeRunDirError, ArgumentsError, LaunchOptionError) as e:
            raise UsageError(f"%ddp_compare: {e}") from None

    @magic_arguments()
    @argument("run", nargs="?", help="a run id, or its end (default: the last run, or the session's last "
                                     "failed %%%%ddp cell when nothing ended after it)")
    @line_magic
    def ddp_debug(self, line: str) -> None:
        """Print what the failed ranks' variables held when they raised (the last run, the kernel's
        session's last failed ``%%ddp`` cell, or RUN): per failed rank, the locals of the innermost
        frame of user code, then the frames above it."""
        run_id = _parse(self.ddp_debug, line).run
        cell = self._failed_cell() if run_id is None else None
        if cell is not None:  # the kernel's session had a cell fail after the last run ended
            print(f"Session: {request_text(cell)}")
            _print_locals([f for f in cell.failures if f.locals_frames])
            return
        run = _run("ddp_debug", run_id)
        failures = [f for f in run.failures if f.locals_frames]
        failed_cell = run.state.failed_cell
        if not failures and failed_cell is not None and any(f.locals_frames for f in failed_cell.failures):
            print(f"Run {run.id}, session cell {failed_cell.cell} ({failed_cell.first_line()}):")
            _print_locals([f for f in failed_cell.failures if f.locals_frames])
            return
        if not failures:
            why = ("it has not failed" if not run.failures else
                   "no failed rank recorded its variables (they are recorded for an exception in user code)")
            print(f"Run {run.id} ({run.status}): nothing to show: {why}.")
            return
        _print_locals(failures)

    def _failed_cell(self) -> Any:
        """The last failed ``%%ddp`` cell of the kernel's session (``_ddp_session``) when nothing
        ended since: no run ended after it (the session's own run aside)."""
        session = self.user_ns.get("_ddp_session")
        current = getattr(session, "current_run", None)
        cell = current.state.failed_cell if current is not None else None
        if cell is None:
            return None
        run = last_run()
        if run is not None and run is not current and (run.state.ended_at or time.time()) > cell.time:
            return None
        return cell

    @magic_arguments()
    @argument("run", nargs="?", help="a run id, or its end (default: the last run)")
    @argument("--grace", type=_grace, metavar="SECONDS",
              help="seconds before workers that ignore the request are terminated")
    @line_magic
    def ddp_stop(self, line: str) -> None:
        """Ask the last run (or RUN) to stop (ctx.should_stop), forced after the grace period."""
        args = _parse(self.ddp_stop, line)
        run = _run("ddp_stop", args.run)
        if run.state.finished:
            print(f"Run {run.id} has already ended ({run.status}): nothing to stop.")
            return
        grace = run.options.stop_grace if args.grace is None else args.grace
        try:
            run.stop(grace=grace)
        except DDPNotebookError as e:  # a bad grace, or a run another notebook process runs
            raise UsageError(f"%ddp_stop: {e}") from None
        print(f"Stopping run {run.id} on {','.join(run.state.devices)}: each worker sees ctx.should_stop and may "
              f"finish its step; those still running after {grace:g} s are ended.")

    @magic_arguments()
    @argument("run", nargs="?", help="a run id, or its end (default: the last run)")
    @argument("--device", help="the device to retry on (default: the main one, or the first healthy one)")
    @argument("-d", "--devices", help="a device list to retry on instead (e.g. to resume a run cut off "
                                                  "by a kernel restart on all its devices)")
    @argument("--resume", action="store_true", help="continue from the last checkpoint")
    @argument("--without-failed", action="store_true", help="retry on every device except the failed ones")
    @line_magic
    def ddp_retry(self, line: str) -> None:
        """Re-run the last run (or RUN) on a single device (or without its failed devices)."""
        args = _parse(self.ddp_retry, line)
        run = _run("ddp_retry", args.run)
        if not run.done and not run.stop_requested:
            raise UsageError(f"%ddp_retry: run {run.id} is still {run.status}; stop it first (%ddp_stop)")
        if not run.done:  # stopping: retry once it has ended (within its grace period)
            print(f"Waiting for run {run.id} to stop before the retry (workers that ignore the stop are ended "
                  f"after {run.options.stop_grace:g} s)...", flush=True)
            run.stop(wait=True)
        if run.status == "succeeded":
            raise UsageError(f"%ddp_retry: run {run.id} succeeded: there is nothing to retry (%ddp_fit runs it again)")
        try:
            new = run.retry_without_failed(resume=args.resume) if args.without_failed else \
                run.retry(device=args.device, resume=args.resume, devices=args.devices)
        except DDPNotebookError as e:  # a retry only starts a run: whatever refuses it is what the user must change
            raise UsageError(f"%ddp_retry: {e}") from None
        self._started(new)
        show_run(new, on_start=self._started)


def _print_locals(failures: list[WorkerFailure]) -> None:
    """Per failed rank: its headline, the locals of the innermost frame of user code, then the
    frames above it."""
    if not failures:
        print("No failed rank recorded its variables (they are recorded for an exception in user code).")
    for failure in failures:
        how = " (knock-on)" if failure.consequence else ""
        print(f"{failure.headline()}{how}")
        print("\n".join(format_locals(failure, file_name)))
        for frame in failure.locals_frames[1:]:
            where = f"{frame.get('function')} ({file_name(str(frame.get('file')))}:{frame.get('line')})"
            names = frame.get("locals") or {}
            width = max((len(n) for n in names), default=0)
            print(f"Locals in {where}:")
            print("\n".join(f"  {n.ljust(width)} = {v}" for n, v in names.items()) or "  (none)")
        print()


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext ddp_notebook``: the magics, the panel as a ``Run``'s display, and the fork
    server started now (it imports torch in the background), so the first ``%ddp_fit`` does not
    wait for it."""
    ipython.register_magics(DDPMagics)
    display.register(ipython)
    start_fork_server()


def unload_ipython_extension(ipython: Any) -> None:
    """``%unload_ext ddp_notebook``: the magics and the panel display removed, and the fork server
    ended once no run uses it. Runs in progress go on."""
    magics = ipython.magics_manager.magics["line"]
    for name in ("ddp_devices", "ddp_fit", "ddp_status", "ddp_runs", "ddp_stop", "ddp_retry", "ddp_debug",
                 "ddp_compare"):
        magics.pop(name, None)
    display.unregister(ipython)
    stop_fork_server()
