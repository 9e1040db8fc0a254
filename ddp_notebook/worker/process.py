"""The worker process: run as ``__main__`` by ``boot`` (started by the local backend).

It imports torch first, then waits for its assignment on its control pipe, so a pool can keep
such processes warm between runs. It reports over an inherited pipe (never a socket), watches a
second pipe as its lifeline (EOF = the notebook is gone: exit at once), runs its rank, and
leaves with ``os._exit`` once the supervisor has every rank's result, so interpreter teardown
can neither hang nor turn a success into a failure. A fresh interpreter leaving on its own first
ends its watcher (``boot.tie_to_parent``); leaving because the notebook is gone, it lets the
watcher end its process group. A worker the fork server forked has no watcher: the server ends its
group (``zygote``).
"""
from __future__ import annotations

import faulthandler
import io
import json
import os
import sys
import threading
import time
from typing import Any, Optional

from ..core.events import EventKind, encode, read_frame, write_all
from ..core.rundir import RunDir
from ..transfer.packing import Placement, pack
from ..transfer.queues import Asker, ask_with, send_items_with
from .boot import BOOT_ENV, EXIT_FAILED, EXIT_ORPHANED, dismiss_watcher, take_watcher
from .channel import PipeChannel, take_answers, watch_lifeline
from .context import current_context, peak_memory
from .execute import Where, execute, flush_std, install_stack_dump, warm_up
from .failure_event import error_event


def _flush_progress() -> None:
    ctx = current_context()
    if ctx is not None:
        ctx.flush(held=True)


def _items_through(channel: PipeChannel) -> None:
    """Send what the function puts in a queue of the call (``transfer.queues``) to the notebook, its
    tensors in shared memory this process holds until it exits, as it holds its result's; ask the
    notebook's queue what the function asks of it."""
    held: list[Placement] = []

    def send(index: int, obj: Any) -> None:
        item = pack(obj)
        placed = item.place() if item.pieces else None
        if placed is not None:
            held.append(placed)
        channel.send({"kind": EventKind.QUEUE_PUT, "queue": index, "data": placed.table if placed else None},
                     item.data)

    send_items_with(send)
    asker = Asker(channel.send)  # get, empty, qsize: asked of the notebook's queue, answered on the lifeline
    ask_with(asker.ask)
    take_answers("queue_answer", asker.answered)


class _NoInput(io.TextIOBase):
    """A worker's standard input: nothing can answer it, and ``input()`` says so (an ``EOFError``,
    what code that reads its input expects at its end) rather than fail on a closed file."""

    def readable(self) -> bool:
        return True

    def read(self, size: Optional[int] = -1) -> str:
        raise EOFError("a worker has no standard input: input() cannot be answered on a rank (pass the value "
                       "to the function, or push it to a session's ranks: session.push(name=value))")

    def readline(self, size: Optional[int] = -1) -> str:  # type: ignore[override]
        return self.read(size)


def main() -> None:
    sys.stdin = _NoInput()
    # What a rank prints that UTF-8 cannot carry (a lone surrogate) is shown escaped, as a session's
    # rank shows it (and as Python writes stderr), not raised in the middle of training.
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(errors="backslashreplace")
    boot: dict[str, Any] = json.loads(os.environ.pop(BOOT_ENV))
    watcher = take_watcher()
    # Segfaults and aborts print the Python stack to stderr, which the supervisor captures.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    warm_error: Optional[BaseException] = None
    try:
        warm_up(bool(boot.get("pooled")))
    except BaseException as e:  # noqa: BLE001 - reported once the worker knows its rank
        warm_error = e
    # Tell whoever holds this process that it is warm (the pool looks, the run logs it).
    write_all(boot["event_fd"], encode({"kind": EventKind.WARM, "rank": -1, "pid": os.getpid(), "time": time.time()}))
    cfg: Any = read_frame(boot["control_fd"])
    if cfg is None:  # the pool was shut down, or the notebook is gone
        dismiss_watcher(watcher)
        os._exit(EXIT_ORPHANED)
    channel = PipeChannel(boot["event_fd"], cfg["rank"])
    _items_through(channel)
    stop, release = threading.Event(), threading.Event()
    threading.Thread(target=watch_lifeline, args=(boot["control_fd"], stop, release, _flush_progress),
                     name="ddp-lifeline", daemon=True).start()
    directory = RunDir(cfg["run_dir"])
    stacks = install_stack_dump(directory.stack_file(cfg["rank"]))  # open until os._exit
    channel.send({"kind": EventKind.STARTED, "pid": os.getpid(), "main_thread": threading.get_ident()})
    where = Where()
    try:
        if warm_error is not None:
            raise warm_error
        # The packed call came with the assignment, over the control pipe: no file another user
        # could have written is ever unpickled.
        payload = cfg.pop("blob")
        result = execute(cfg, payload, channel.send, stop, where)
        # The result's tensors go into shared memory this process holds until it exits: the
        # notebook opens it (through /proc) on this event, before it releases the ranks.
        placed = result.place() if result is not None else None
        channel.send({"kind": EventKind.DONE, "data": placed.table if placed else None, "memory": peak_memory()},
                     result.data if result is not None else None)
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit included, is reported
        channel.send(error_event(exc, where.phase))
        flush_std()
        dismiss_watcher(watcher)
        os._exit(EXIT_FAILED)
    # Stay until every rank is done: a rank leaving early could cut a peer's last collective.
    release.wait()
    flush_std()
    stacks.flush()
    dismiss_watcher(watcher)
    os._exit(0)


if __name__ == "__main__":
    main()
