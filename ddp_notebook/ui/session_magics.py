"""The session magics: ``%ddp_session cpu*2`` forms the kernel's current session (``_ddp_session``),
``%%ddp`` runs a cell on its ranks (``%%ddp --ranks 0,2`` on some), ``%ddp_session --stop`` ends it.
Each parses its arguments and calls ``lifecycle.session``."""
from __future__ import annotations

import argparse
import re
import sys
import traceback
from concurrent.futures import Future
from typing import Any, NamedTuple, Optional, Union

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..core.devices import parse_devices
from ..core.errors import (
    ArgumentsError,
    DeviceSpecError,
    NotPicklableError,
    SessionBusyError,
    SessionEndedError,
    SessionInterrupted,
)
from ..core.failures import ranks_text
from ..lifecycle.options import UI_FORMS
from ..lifecycle.restarts import show_follow_ons_with
from ..lifecycle.session import CellFuture, Session, current_session, session, set_current_session
from .display import show_session
from .magics import _USER_MISTAKES, _device_list, _engines_named, _parse, _stall_setting

__all__ = ["SessionMagics", "SESSION_MAGICS"]

#: The magics this module registers (``unload_ipython_extension`` removes them).
SESSION_MAGICS = (("line", "ddp_session"), ("cell", "ddp"))


_RANK_ITEM = r"[0-9]+(-[0-9]+)?"
_RANK_SLICE = r"(-?[0-9]+)?:(-?[0-9]+)?(:(-?[0-9]+)?)?"


class _Ranks(NamedTuple):
    """What ``--ranks`` chose (ranges of ranks, both ends included, or a slice of them), and how it
    was written."""

    chosen: Union[list[tuple[int, int]], slice]
    text: str


def _rank_choice(text: str) -> _Ranks:
    """``--ranks``: ``0``, ``0,2``, a range inclusive as device lists are (``0-2``, ``0,2-3``),
    or a Python slice of the ranks (``1:``, ``::2``, ``:-1``).

    >>> _rank_choice("0,2-3").chosen, _rank_choice("1:").chosen, _rank_choice("::2").chosen
    ([(0, 0), (2, 3)], slice(1, None, None), slice(None, None, 2))
    """
    words = "".join(text.split())
    if re.fullmatch(_RANK_SLICE, words):
        parts = [int(p) if p else None for p in (words.split(":") + [""])[:3]]
        if parts[2] == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: a slice's step cannot be 0")
        return _Ranks(slice(*parts), words)
    if not re.fullmatch(f"{_RANK_ITEM}(,{_RANK_ITEM})*", words):
        raise argparse.ArgumentTypeError(f"{text!r} is not a choice of ranks: a rank (0), a list (0,2), a range "
                                         "(0-2, both ends included) or a slice (1:, ::2)")
    ranges = []
    for item in words.split(","):
        first, _, last = item.partition("-")
        if last and int(last) < int(first):
            raise argparse.ArgumentTypeError(f"{text!r}: the range {item} ends before it starts")
        ranges.append((int(first), int(last or first)))
    return _Ranks(ranges, words)


def _announce(current: Session, how: str, ui: Optional[str], more: str = "") -> None:
    """Say the session is ``how`` (ready, live), on which devices and in which run, then show it
    (its live view, in a notebook)."""
    run = current.current_run
    print(f"Session {how}: {_ranks(current.world_size)} on {', '.join(current.devices)} "
          f"(run {run.id if run else '-'}). %%ddp runs a cell on every rank{more}.")
    show_session(current, ui)


def _follow_reform(before: Any, new: Any) -> None:
    """The current session formed again (restart, Re-form, a request cut): the notebook's
    ``_ddp_run`` is its new run."""
    value = current_session()
    if value is not None and value.current_run is new:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.user_ns["_ddp_run"] = new


show_follow_ons_with(_follow_reform)


@magics_class
class SessionMagics(Magics):
    @property
    def user_ns(self) -> dict[str, Any]:
        assert self.shell is not None
        return self.shell.user_ns

    def _set_current(self, value: Optional[Session]) -> None:
        set_current_session(value)
        if value is None:
            self.user_ns.pop("_ddp_session", None)
        else:
            self.user_ns["_ddp_session"] = value
            self.user_ns["_ddp_run"] = value.current_run  # the run that holds the ranks: %ddp_status shows it

    def _ready(self, current: Session, how: str, ui: Optional[str], more: str = "") -> None:
        """Make ``current`` the kernel's session and say so (``_announce``); Kernel → Interrupt
        meanwhile stops only the saying, in one line: the session is formed."""
        try:
            self._set_current(current)
            _announce(current, how, ui, more)
        except KeyboardInterrupt:
            self._set_current(current)
            raise SessionInterrupted(f"Showing the session was interrupted; it is {how} on "
                                     f"{', '.join(current.devices)} (%ddp_session shows it)") from None

    @magic_arguments()
    @argument("devices", nargs="*", help="device list, one rank per device, e.g. cpu*2 (default: the kernel's)")
    @argument("--stall-timeout", type=_stall_setting, metavar="SECONDS|auto|off",
              help="the hang watchdog for cells: SECONDS without progress in a cell ends the session; auto (the "
                   "default) names a rank frozen while its peers wait for it; off")
    @argument("--engines", help="one rank per ipyparallel engine: the name of a Client or DirectView")
    @argument("--ui", choices=UI_FORMS, type=str.lower,
              help="how the session shows: widget (its run's panel), html or text (kept "
                   "current in place, where widgets do not render); default "
                   "$DDP_NOTEBOOK_UI, else the panel (html in Colab)")
    @argument("--stop", action="store_true", help="close the current session")
    @argument("--restart", action="store_true", help="form the current session again (its namespaces are lost), "
                                                     "on the devices given, else on its own")
    @argument("--without-failed", action="store_true", help="with --restart: on the devices whose ranks did not "
                                                            "cause the failure that ended the session")
    @line_magic
    def ddp_session(self, line: str) -> None:
        """Form a session of ranks that stay (the kernel's current one, also ``_ddp_session``);
        ``%%ddp`` then runs cells on them. Without arguments while one lives, show it."""
        args = _parse(self.ddp_session, line)
        current = current_session()
        if args.stop and args.restart:
            raise UsageError("%ddp_session: --stop closes the session and --restart forms it again: give one of them")
        if args.without_failed and not args.restart:
            raise UsageError("%ddp_session: --without-failed goes with --restart")
        if args.stop or args.restart:
            if args.devices and args.stop:
                raise UsageError("%ddp_session: --stop takes no device list")
            if current is None:
                raise UsageError("%ddp_session: there is no session; %ddp_session cpu*2 forms one")
            if args.stop:
                current.close()
                self._set_current(None)
                print(f"Session closed (run {current.current_run.id if current.current_run else '-'}).")
                return
            try:
                current.restart(devices=_device_list(args.devices), without_failed=args.without_failed)
            except _USER_MISTAKES as e:
                raise UsageError(f"%ddp_session: {e}") from None
            self._ready(current, "ready", args.ui)
            return
        options: dict[str, Any] = {}
        if args.stall_timeout is not None:
            options["stall_timeout"] = None if args.stall_timeout == "off" else args.stall_timeout
        if args.ui is not None:
            options["ui"] = args.ui
        if args.engines is not None:
            try:
                options["engines"] = _engines_named(args.engines, self.shell.user_ns if self.shell is not None else {})
            except KeyError as e:
                raise UsageError(f"%ddp_session: there is no {e.args[0]!r} in the notebook; --engines takes the name "
                                 "of an ipyparallel Client or DirectView") from None
        spec = _device_list(args.devices)
        if current is not None and not current.alive and spec is None and args.stall_timeout is None \
                and args.engines is None:
            # It ended (a rank died, a stall): shown with why, as the line asks; forming it again is asked apart.
            state = current.state
            print(f"Session {state.run_id} {state.session_status}: %ddp_session --restart forms it again on "
                  f"{', '.join(current.devices)} "
                  "(its namespaces were lost with its ranks), --restart DEVICES on others.")
            show_session(current, args.ui)
            return
        if current is not None and current.alive:
            # A session lives: the line most often means "show me the session". Anything that
            # would need new ranks is refused, never done at the cost of its namespaces.
            try:
                same = spec is None or [str(d) for d in parse_devices(spec)] == current.devices
            except DeviceSpecError as e:
                raise UsageError(f"%ddp_session: {e}") from None
            if not same or args.stall_timeout is not None or args.engines is not None:
                asked = f"on {spec}" if not same else "with --stall-timeout" if args.stall_timeout is not None \
                    else "on engines"
                raise UsageError(
                    f"%ddp_session: a session lives on {', '.join(current.devices)}; a new one {asked} would lose "
                    "its namespaces. " + (f"%ddp_session --restart {spec} forms it again on those devices, "
                                          if not same else "") + "%ddp_session --stop closes it.")
            self._ready(current, "live", args.ui, "; %ddp_session --restart forms it again")
            return
        try:
            formed = session(spec, **options)
        except _USER_MISTAKES as e:
            raise UsageError(f"%ddp_session: {e}") from None
        self._ready(formed, "ready", args.ui)

    @magic_arguments()
    @argument("--ranks", type=_rank_choice, metavar="RANKS",
              help="run on these ranks only: 0, 0,2, a range 0-2 (both ends included) or a slice 1: or ::2 "
                   "(default: every rank)")
    @argument("--noblock", action="store_true",
              help="return at once and let the ranks run the cell: the notebook stays free, the output and values "
                   "come below as they arrive, and Stop in the session's view interrupts it")
    @cell_magic
    def ddp(self, line: str, cell: str) -> None:
        """Run the cell on every rank of the current session (each in its own namespace, kept across
        cells); prints each rank's output live and the value of the cell's last expression per rank."""
        # A slice from the end (--ranks -1:) is a value, not an option as argparse would take it.
        args = _parse(self.ddp, re.sub(r"(--ranks)\s+(?=-[0-9:])", r"\1=", line), shown="%%ddp")
        current = current_session()
        if current is None:
            raise UsageError("%%ddp: there is no session; %ddp_session cpu*2 forms one")
        if not current.alive:
            try:
                current.run_cell("", namespace=self.user_ns)  # raises what ended it
            except SessionEndedError as e:
                raise UsageError(f"%%ddp: {e} (or %ddp_session --restart)") from None
        ranks = _chosen(args.ranks, current.world_size)
        try:
            done = current.run_cell(cell, ranks=ranks, namespace=self.user_ns, block=not args.noblock, show=True,
                                    announce=lambda number: print(
                                        f"Cell {number} runs on {ranks_text(ranks)} without blocking: its output "
                                        "and values come below; Stop in the session's view interrupts it. "
                                        "_ddp_cell.result() waits for it.", flush=True))
        except (ArgumentsError, SessionBusyError, NotPicklableError) as e:
            raise UsageError(f"%%ddp: {e}") from None
        except SyntaxError as e:  # the cell's, said as Python says it (no frame of this package)
            raise UsageError("%%ddp: the cell is not valid Python (nothing was sent to the ranks):\n"
                             + "".join(traceback.format_exception_only(e)).rstrip()) from None
        if isinstance(done, CellFuture):
            self.user_ns["_ddp_cell"] = done
            show_session(current)
            done.add_done_callback(_say_error)


def _chosen(choice: Optional[_Ranks], world_size: int) -> list[int]:
    """The ranks ``--ranks`` chose in a session of ``world_size`` ranks."""
    if choice is None:
        return list(range(world_size))
    valid = "0" if world_size == 1 else f"0 to {world_size - 1}"
    if isinstance(choice.chosen, slice):
        ranks = list(range(world_size))[choice.chosen]
        if not ranks:
            raise UsageError(f"%%ddp: --ranks {choice.text} chooses no rank of this session (its ranks are {valid})")
        return ranks
    outside = [(max(first, world_size), last) for first, last in choice.chosen if last >= world_size]
    if outside:
        said = ", ".join(str(first) if first == last else f"{first} to {last}" for first, last in outside)
        named = f"{said} is not a rank" if len(outside) == 1 and outside[0][0] == outside[0][1] else \
            f"{said} are not ranks"
        raise UsageError(f"%%ddp: --ranks {choice.text}: {named} of this session (its ranks are {valid})")
    return [rank for first, last in choice.chosen for rank in range(first, last + 1)]


def _say_error(future: Future[Any]) -> None:
    """A cell run without blocking has ended (its values were shown as they came): its error,
    if it raised, as the notebook shows one (the failure report, without this package's frames)."""
    error = future.exception()
    if error is None:
        return
    render = getattr(error, "_render_traceback_", None)
    lines = render() if callable(render) else [f"{type(error).__name__}: {error}"]
    print("\n".join(lines), file=sys.stderr)


def _ranks(n: int) -> str:
    return f"{n} rank{'' if n == 1 else 's'}"
