"""A rank of a session: the function a session launches, which keeps the rank and its process
group alive and runs the cells the notebook sends (``lifecycle.session`` is the notebook's side).

The notebook's requests come as frames on the rank's control pipe (``core.events.Control``,
read by the lifeline's thread, ``worker.channel``), and the rank answers through its channel, as
``session`` events beside the run's own (the run's supervisor hands them to the session): one
transport and one codec for the run and its cells. Each frame carries what routes it (``op``,
``id``, ``cell``) and the rest pickled as its attachment. The rank says ``hello`` once it serves,
then serves requests until the notebook says ``close`` or goes (the lifeline ends it):

- ``run``: the cell's code, compiled under a file name of its own (its source goes into
  ``linecache``, so a traceback shows the cell's lines), executed in the rank's namespace (kept
  across cells: ``rank``, ``world_size``, ``ctx``, ``torch``, ``dist`` and whatever cells define),
  with the notebook's functions and imports the cell uses put there first; what the cell prints
  goes to the notebook live, as the run's ``output`` events naming the cell (the run records
  them, and what the cell's threads print after it); the reply is
  the value of the cell's last expression, or the error event a launch would send (traceback with
  the cell's lines, the failed frame's locals). The value travels pickled on its own, with its
  text computed here (``value``: asked for; a value that cannot be pickled comes as its text
  alone), and its display bundle when the notebook shows it (``show``: a figure as an image);
  what the cell displays (``display()``, HTML, ``plt.show()``) goes to the notebook as a bundle
  too (``display`` frames), through an IPython shell of the rank's own;
- ``push`` / ``pull``: values into, and out of, the namespace (a push's large tensors and arrays
  are mapped from the notebook's shared memory, as a launch's are);
- ``interrupt``: a SIGINT to this rank's main thread while that cell runs (a cell sleeping or
  in a Python loop gets a ``KeyboardInterrupt``; one blocked in native code, a collective, is not
  interrupted);
- ``ping``: answered at once by the lifeline's thread (``pong``): a rank raised in a cell that
  this one is not in, and the run's supervisor makes sure this one lives before that error is
  believed;
- ``idle``: every rank has finished the last cell: with a strict ``stall_timeout`` the rank
  reports progress while idle, so that the watchdog judges cells, not the time between them.

Everything the rank sends is one stream, in order: a cell's output always arrives before its
reply.
"""
from __future__ import annotations

import ast
import builtins
import linecache
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Optional

from ..core.bounds import LINE_CHARS
from ..core.events import SESSION_ROUTED, EventKind, cell_file_name
from ..core.failures import Phase
from ..transfer import pickling
from ..transfer.loading import load
from .channel import Channel, rank_channel, take_requests
from .context import WorkerContext
from .failure_event import error_event
from .rank_display import RankDisplay

__all__ = ["serve_session", "compile_cell", "OUTPUT_EVERY", "OUTPUT_PIECE"]
_NONE = object()


def compile_cell(code: str, filename: str) -> tuple[Any, Optional[Any]]:
    """The cell's statements, and its last expression apart (None when it ends with a statement),
    compiled as IPython compiles a cell: its value is the cell's result."""
    tree = ast.parse(code, filename, "exec")
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body[-1].value)
        tree.body.pop()
    body = compile(tree, filename, "exec")
    return body, (compile(last, filename, "eval") if last is not None else None)


#: Seconds what a rank writes waits for what follows it, so that it goes as one event (the pieces
#: one ``print`` writes, a flood's lines), not one event a write.
OUTPUT_EVERY = 0.05
#: Characters of output one event carries at most (a longer write goes in several).
OUTPUT_PIECE = 128 * 1024


class _Output:
    """What the rank writes to ``sys.stdout`` and ``sys.stderr`` while it serves, sent to the
    notebook as the run's ``output`` events naming the cell that wrote it (the run keeps them, the
    cell shows them), on the channel the answers take: gathered for ``OUTPUT_EVERY`` by a thread
    of its own, sent at once on ``flush()`` (``print(..., flush=True)``), and before each answer, so
    that a cell's output always comes before its reply. What native code writes to the file
    descriptors takes the run's usual way, and so does what the sending itself writes (a warning):
    sent, it would wait for itself."""

    _sending_now = threading.local()

    def __init__(self, channel: Channel, cell: Callable[[], Optional[int]]) -> None:
        self.channel, self.cell = channel, cell
        self._items: list[tuple[str, str, Optional[int]]] = []  # (stream, text, cell), in order
        self._size = 0
        self._lock = threading.Lock()  # the items
        self._sending = threading.Lock()  # one sender at a time: the events leave in order
        self._wake = threading.Event()
        self._closed = False
        threading.Thread(target=self._send_soon, name="ddp-session-output", daemon=True).start()

    def stream(self, original: IO[str], name: str) -> IO[str]:
        """``original`` (``sys.stdout`` or ``sys.stderr``) as it writes while the rank serves."""
        return _Stream(original, name, self)  # type: ignore[return-value]

    def write(self, stream: str, text: str, original: IO[str]) -> None:
        if self._closed or getattr(self._sending_now, "on", False):  # (closed: a cell's thread, after the session)
            original.write(text)
            return
        with self._lock:
            self._items.append((stream, text, self.cell()))
            self._size += len(text)
            full = self._size >= OUTPUT_PIECE
        if full:
            self.flush()
        else:
            self._wake.set()

    def flush(self) -> None:
        """Send what was written so far."""
        with self._sending:
            with self._lock:
                items, self._items, self._size = self._items, [], 0
            self._sending_now.on = True
            try:
                for stream, text, cell in _joined(items):
                    for start in range(0, len(text), OUTPUT_PIECE):
                        self.channel.send({"kind": EventKind.OUTPUT, "stream": stream, "cell": cell,
                                           "text": text[start:start + OUTPUT_PIECE]})
            finally:
                self._sending_now.on = False

    def _send_soon(self) -> None:
        while not self._closed:
            self._wake.wait()
            time.sleep(OUTPUT_EVERY)  # what follows goes with it
            self._wake.clear()
            self.flush()

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self.flush()


def _joined(items: list[tuple[str, str, Optional[int]]]) -> list[tuple[str, str, Optional[int]]]:
    """Writes in a row to one stream from one cell as one text, any character the notebook could
    not write (a lone surrogate) escaped.

    >>> _joined([("stdout", "a", 1), ("stdout", "\\n", 1), ("stderr", "x\\ud800", 1), ("stdout", "b", None)])
    [('stdout', 'a\\n', 1), ('stderr', 'x\\\\ud800', 1), ('stdout', 'b', None)]
    """
    out: list[tuple[str, str, Optional[int]]] = []
    for stream, text, cell in items:
        if out and out[-1][0] == stream and out[-1][2] == cell:
            out[-1] = (stream, out[-1][1] + text, cell)
        else:
            out.append((stream, text, cell))
    return [(stream, text.encode("utf-8", "backslashreplace").decode("utf-8"), cell) for stream, text, cell in out]


#: Every ``_Stream`` ever made ``sys.stdout`` or ``sys.stderr``, kept: ``print`` holds the stream
#: it found there without a reference of its own (CPython 3.11), so a thread printing while the
#: session ends and the originals are put back would write through a freed object (an engine
#: crashed so, with a cell's thread printing flat out). Two small objects a session.
_installed: list[IO[str]] = []


class _Stream:
    """A stream whose writes go to the rank's ``_Output`` (to the original once it is closed)."""

    def __init__(self, original: IO[str], name: str, output: _Output) -> None:
        self.original, self.name, self.output = original, name, output

    def write(self, text: str) -> int:
        if text:
            self.output.write(self.name, text, self.original)
        return len(text)

    def flush(self) -> None:
        self.output.flush()

    def __getattr__(self, name: str) -> Any:  # fileno, encoding, isatty...: the stream's own
        return getattr(self.original, name)


class _Rank:
    def __init__(self, ctx: WorkerContext, channel: Channel, heartbeat: Optional[float]) -> None:
        import torch
        import torch.distributed as dist

        self.ctx = ctx
        self.channel = channel
        self.heartbeat = heartbeat
        self.inbox: queue.Queue[dict[str, Any]] = queue.Queue()
        self.cell: Optional[int] = None  # the cell running now
        self.last_cell = 0  # the last cell begun
        self.interrupted: Optional[int] = None  # the cell the notebook asked to interrupt, until it raised
        self.asked_to_leave: Optional[int] = None  # the cell the notebook asked to interrupt
        self.replied = False
        self.leaving = False  # the run stops this rank (an engine's interrupt)
        self.from_notebook: dict[str, Any] = {}  # what the notebook put in the namespace, by name
        self.display = RankDisplay(self.displayed)
        self.output = _Output(channel, lambda: self.cell)
        self.namespace: dict[str, Any] = {
            "__name__": "__ddp_session__", "__builtins__": builtins,
            "rank": ctx.rank, "world_size": ctx.world_size, "ctx": ctx, "torch": torch, "dist": dist,
        }
        if self.display.show is not None:  # as in a notebook, display() needs no import
            self.namespace["display"] = self.display.show

    # ---- talking to the notebook --------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        """Answer the notebook: what routes the answer in the open, the rest pickled (whole,
        whichever thread sends: a thread the cell started may print while the main thread replies)."""
        header, body = pickling.split(message, SESSION_ROUTED)
        self.output.flush()  # what the rank wrote before, first
        self.channel.send({"kind": EventKind.SESSION, **header}, body)
        if message.get("op") in ("done", "error"):
            self.replied = True

    def displayed(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """What the running cell displayed (a bundle): to the notebook, after what it printed."""
        cell = self.cell
        if cell is None:  # a thread of a cell that has ended: its display has no cell to go to
            return
        self.send({"op": "display", "cell": cell, "data": data, "metadata": metadata})

    def take_names(self, names: dict[str, Any]) -> None:
        """Put the notebook's functions, classes and modules the cell names in the namespace,
        except where a cell on this rank bound the name itself: the rank's own is kept."""
        for name, value in names.items():
            if name in self.namespace and self.namespace[name] is not self.from_notebook.get(name, _NONE):
                continue
            self.namespace[name] = self.from_notebook[name] = value

    def requested(self, frame: dict[str, Any]) -> None:
        """A request, on the lifeline's thread: an interrupt is acted on at once, the rest goes to
        the inbox (the main thread serves it; the lifeline answers a ``ping`` itself)."""
        op = frame.get("op")
        if op == "interrupt":
            self.interrupt(frame.get("cell"))
        elif op == "leave":  # the run stops this rank (on an engine): out of any cell, now
            self.leaving = True
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)
        else:
            self.inbox.put(pickling.joined(frame, frame.get("blob"), SESSION_ROUTED))

    def interrupt(self, cell: Any) -> None:
        if not isinstance(cell, int) or (cell != self.cell and cell <= self.last_cell):  # (one that ended)
            return
        # Kept first: a cell not begun yet (its request still on its way to the main thread) is
        # left as it begins (``run_cell`` looks), one begun is interrupted now.
        self.asked_to_leave = cell
        if cell == self.cell:
            self.interrupted = cell
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def on_sigint(self, signum: int, frame: Any) -> None:
        # Only the cell the notebook asked to interrupt is interrupted; a SIGINT at any other
        # time (between cells, a stray Ctrl-C) is ignored: the rank must keep serving. Except once
        # the run stops this rank (``leave``, on an engine, which is not killed): it leaves.
        if self.leaving or (self.cell is not None and self.interrupted == self.cell):
            self.interrupted = None
            raise KeyboardInterrupt

    # ---- serving ------------------------------------------------------------------------------
    def serve(self) -> None:
        idle = False
        while True:
            if self.leaving:  # raised, not returned: the rank was stopped, its peers need not wait
                raise KeyboardInterrupt
            wait = self.heartbeat if idle and self.heartbeat else None
            try:
                message = self.inbox.get(timeout=wait)
            except queue.Empty:  # every rank idle: say so to the watchdog of a strict stall_timeout
                self.ctx.log()  # (progress for the watchdog; no metric: the run counts its cells)
                continue
            if message.get("op") == "close":
                return
            idle = message.get("op") == "idle"
            self.replied = False
            try:
                self.handle(message)
            except KeyboardInterrupt:
                # The interrupt landed just as the cell ended, outside the cell's own handler:
                # the cell was interrupted all the same.
                if not self.replied and message.get("op") == "run":
                    self.send({"op": "error", "id": message["id"], "interrupted": True,
                               "error": _error(KeyboardInterrupt(), time.time())})

    def handle(self, message: dict[str, Any]) -> None:
        op = message.get("op")
        if op == "run":
            self.run_cell(message)
        elif op == "push":
            self.reply(message, lambda: self.push(load(message["values"], message.get("table"))))
        elif op == "pull":
            self.reply(message, lambda: self.pull(message["name"]))

    def push(self, values: dict[str, Any]) -> None:
        self.namespace.update(values)
        self.from_notebook.update(values)  # the notebook's: a later cell may take its newer ones

    def pull(self, name: str) -> Any:
        if name not in self.namespace:  # the same words on every rank: one error, said once
            raise NameError(f"name {name!r} is not defined in the ranks' namespaces", name=name)
        return self.namespace[name]

    def reply(self, message: dict[str, Any], action: Any) -> None:
        try:
            value = action()
        except BaseException as exc:  # noqa: BLE001 - reported to the notebook; the rank serves on
            self.send({"op": "error", "id": message["id"], "error": _error(exc, time.time())})
            return
        self.send({"op": "done", "id": message["id"], **self.value_reply({}, value)})

    def value_reply(self, message: dict[str, Any], value: Any) -> dict[str, Any]:
        """A value (a cell's, a pull's) as the notebook asked for it: pickled (or why it cannot
        be), with its text; its display bundle when the notebook shows it. Nothing for None."""
        reply: dict[str, Any] = {}
        if value is None:
            return reply
        if message.get("show"):
            shown = self.display.bundle(value)
            if shown is not None:  # None: it displayed itself (its _ipython_display_), no Out
                reply["shown"] = shown
        if message.get("value", True):
            reply["text"] = self.display.text(value)
            try:
                reply["value"] = pickling.dumps(value)
            except BaseException as exc:  # noqa: BLE001 - a __reduce__ may raise anything: its text goes instead
                reply["unsent"] = f"{type(exc).__name__}: {exc}"[:LINE_CHARS]
        return reply

    def run_cell(self, message: dict[str, Any]) -> None:
        cell = int(message["cell"])
        filename = cell_file_name(cell)
        code = message["code"]
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        reply: dict[str, Any] = {}
        failed, failed_at = None, 0.0
        try:
            self.cell = self.last_cell = cell
            try:
                if self.asked_to_leave == cell:  # interrupted before it began
                    raise KeyboardInterrupt
                linecache.cache.update(message.get("sources") or {})  # the notebook's cells, for tracebacks
                self.take_names(pickling.loads(message["names"]))
                body, last = compile_cell(code, filename)
                exec(body, self.namespace)
                value = eval(last, self.namespace) if last is not None else None
                self.display.cell_ended()  # figures drawn in the cell are shown, as IPython shows them
                # Still in the cell: a slow repr can be interrupted, and what it prints is shown.
                reply = self.value_reply(message, value)
            except BaseException as exc:  # noqa: BLE001 - the cell's error, KeyboardInterrupt included, is the reply
                failed, failed_at = exc, time.time()
        finally:
            self.cell = None
            self.interrupted = None
        self.ctx.log()  # (progress for the watchdog; no metric: the run counts its cells)
        if failed is not None:
            # Interrupted only when the notebook asked: a cell raising KeyboardInterrupt itself raised.
            asked, self.asked_to_leave = self.asked_to_leave == cell, None
            self.send({"op": "error", "id": message["id"], "error": _error(failed, failed_at),
                       "interrupted": isinstance(failed, KeyboardInterrupt) and asked})
        else:
            self.asked_to_leave = None
            self.send({"op": "done", "id": message["id"], **reply})

def _error(exc: BaseException, when: float) -> dict[str, Any]:
    """The error event of a reply: when it was raised (the first rank to raise is the cause) and,
    for a NameError, the name (the notebook says how to send it when it holds that name)."""
    event = error_event(exc, Phase.RUN)
    event["time"] = when
    if isinstance(exc, NameError) and isinstance(exc.name, str):
        event["name"] = exc.name
    return event


def serve_session(ctx: WorkerContext, heartbeat: Optional[float] = None) -> None:
    """A session's rank: say ``hello``, then run what the notebook sends, until it says
    ``close`` (the run then ends, succeeded) or goes (the lifeline ends the process).

    Parameters
    ----------
    ctx : WorkerContext
        The rank's context (the launch makes it).
    heartbeat : float, optional
        Seconds between progress reports while every rank is idle (with a strict
        ``stall_timeout``); None: none.
    """
    rank = _Rank(ctx, rank_channel(), heartbeat)
    previous = signal.signal(signal.SIGINT, rank.on_sigint)
    out, err = sys.stdout, sys.stderr
    for stream in (out, err):
        stream.flush()
    sys.stdout, sys.stderr = rank.output.stream(out, "stdout"), rank.output.stream(err, "stderr")
    _installed.extend((sys.stdout, sys.stderr))
    take_requests(rank.requested)
    try:
        rank.send({"op": "hello"})
        rank.serve()
    finally:
        take_requests(None)
        sys.stdout, sys.stderr = out, err
        rank.output.close()
        rank.display.close()
        signal.signal(signal.SIGINT, previous)
