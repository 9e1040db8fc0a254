"""The session magics: ``%ddp_session cpu*2`` forms the kernel's current session (``_ddp_session``),
``%%ddp`` runs a cell on its ranks (``%%ddp --ranks 0,2`` on some), ``%ddp_session --stop`` ends it.
Each parses its arguments and calls ``lifecycle.session``."""
from __future__ import annotations

import argparse
import re
import sys
import traceback
from concurrent.futures import Future
from typing import Any, Optional

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from ..core.errors import ArgumentsError, DeviceSpecError, LaunchOptionError, SessionBusyError, SessionEndedError
from ..core.validation import InvalidDevicesError
from ..lifecycle.session import CellFuture, Session, current_session, session, set_current_session, show_sessions_with
from .display import in_notebook
from .magics import _device_list, _parse, _stall_setting

__all__ = ["SessionMagics", "SESSION_MAGICS", "show_session_view"]

#: The magics this module registers (``unload_ipython_extension`` removes them).
SESSION_MAGICS = (("line", "ddp_session"), ("cell", "ddp"))


def _rank_list(text: str) -> list[int]:
    """``--ranks``: ``0`` or ``0,2``."""
    if not re.fullmatch(r"\s*[0-9]{1,6}(\s*,\s*[0-9]{1,6})*\s*", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank or a list of ranks such as 0 or 0,2")
    return [int(word) for word in text.split(",")]


def show_session_view(value: Session) -> bool:
    """A session displayed in a notebook shows its live view (the hook of
    ``Session._ipython_display_``); elsewhere, False: it shows its text."""
    if not in_notebook():
        return False
    from .session_view import show_session  # ipywidgets: only in a notebook

    show_session(value, on_reform=_follow_reform)
    return True


def _follow_reform(value: Session) -> None:
    """After a Re-form in a view, the notebook's ``_ddp_run`` is the current session's new run."""
    if current_session() is value:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            shell.user_ns["_ddp_run"] = value.current_run


show_sessions_with(show_session_view)


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

    @magic_arguments()
    @argument("devices", nargs="*", help="device list, one rank per device, e.g. cpu*2 (default: the kernel's)")
    @argument("--stall-timeout", type=_stall_setting, metavar="SECONDS|auto|off",
              help="the hang watchdog for cells: SECONDS without progress in a cell ends the session; auto (the "
                   "default) names a rank frozen while its peers wait for it; off")
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
            except (DeviceSpecError, InvalidDevicesError, LaunchOptionError, ArgumentsError) as e:
                raise UsageError(f"%ddp_session: {e}") from None
            self._set_current(current)
            print(f"Session ready: {_ranks(len(current.devices))} on {', '.join(current.devices)}.")
            return
        options: dict[str, Any] = {}
        if args.stall_timeout is not None:
            options["stall_timeout"] = None if args.stall_timeout == "off" else args.stall_timeout
        if current is not None and current.alive and not args.devices and args.stall_timeout is None:
            # Nothing asked of a new one: the live session is shown, its namespaces kept.
            print(f"Session live: {_ranks(current.world_size)} on {', '.join(current.devices)}. "
                  "%ddp_session DEVICES forms a new one (this one's namespaces would be lost).")
            show_session_view(current)
            return
        if current is not None and current.alive:
            current.close()
            print("The previous session was closed (its namespaces are lost).")
        try:
            formed = session(_device_list(args.devices), **options)
        except (DeviceSpecError, InvalidDevicesError, LaunchOptionError, ArgumentsError) as e:
            raise UsageError(f"%ddp_session: {e}") from None
        self._set_current(formed)
        run = formed.current_run
        print(f"Session ready: {_ranks(formed.world_size)} on {', '.join(formed.devices)} "
              f"(run {run.id if run else '-'}). %%ddp runs a cell on every rank.")
        show_session_view(formed)  # its live view, in a notebook

    @magic_arguments()
    @argument("--ranks", type=_rank_list, metavar="R[,R...]", help="run on these ranks only (default: every rank)")
    @argument("--noblock", action="store_true",
              help="return at once and let the ranks run the cell: the notebook stays free, the output and values "
                   "come below as they arrive, and Stop in the session's view interrupts it")
    @cell_magic
    def ddp(self, line: str, cell: str) -> None:
        """Run the cell on every rank of the current session (each in its own namespace, kept across
        cells); prints each rank's output live and the value of the cell's last expression per rank."""
        args = _parse(self.ddp, line, shown="%%ddp")
        current = current_session()
        if current is None:
            raise UsageError("%%ddp: there is no session; %ddp_session cpu*2 forms one")
        if not current.alive:
            try:
                current.run_cell("", namespace=self.user_ns)  # raises what ended it
            except SessionEndedError as e:
                raise UsageError(f"%%ddp: {e} (or %ddp_session --restart)") from None
        ranks = args.ranks if args.ranks is not None else list(range(current.world_size))
        try:
            done = current.run_cell(cell, ranks=ranks, namespace=self.user_ns, block=not args.noblock)
        except (ArgumentsError, SessionBusyError) as e:
            raise UsageError(f"%%ddp: {e}") from None
        except SyntaxError as e:  # the cell's, said as Python says it (no frame of this package)
            raise UsageError("%%ddp: the cell is not valid Python (nothing was sent to the ranks):\n"
                             + "".join(traceback.format_exception_only(e)).rstrip()) from None
        if isinstance(done, CellFuture):
            print(f"Cell {done.cell} runs on {_rank_words(ranks)} without blocking: its output and values come below; "
                  "Stop in the session's view interrupts it. _ddp_cell.result() waits for it.")
            self.user_ns["_ddp_cell"] = done
            show_session_view(current)
            done.add_done_callback(lambda future: _say_outcome(future, ranks))
            return
        _print_values(ranks, done)


def _print_values(ranks: list[int], values: list[Any]) -> None:
    for rank, value in zip(ranks, values):
        if value is not None:
            print(f"[rank {rank}] Out: {value!r}")


def _say_outcome(future: Future[Any], ranks: list[int]) -> None:
    """A cell run without blocking has ended: its values, or its error as the notebook shows one
    (the failure report, without this package's frames)."""
    error = future.exception()
    if error is None:
        _print_values(ranks, future.result())
        return
    render = getattr(error, "_render_traceback_", None)
    lines = render() if callable(render) else [f"{type(error).__name__}: {error}"]
    print("\n".join(lines), file=sys.stderr)


def _rank_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _ranks(n: int) -> str:
    return f"{n} rank{'' if n == 1 else 's'}"
