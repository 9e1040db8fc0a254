"""A rank of a session: the function a session launches, which keeps the rank and its process
group alive and runs the cells the notebook sends (``lifecycle.session`` is the notebook's side).

The rank connects to the notebook's Unix socket (in an owner-only folder, and the first frame
carries the session's token), then serves requests until the notebook says ``close`` or goes:

- ``run``: the cell's code, compiled under a file name of its own (its source goes into
  ``linecache``, so a traceback shows the cell's lines), executed in the rank's namespace (kept
  across cells: ``rank``, ``world_size``, ``ctx``, ``torch``, ``dist`` and whatever cells define),
  with the notebook's functions and imports the cell uses put there first; what the cell prints
  goes to the notebook live (and to the rank's own output, which the run records); the reply is
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
- ``where``: while that cell runs, the main thread's frames (file, line, function), innermost
  first, read by the reader thread (a rank blocked in a collective has released the GIL), and
  the process's CPU time: the notebook tells from them a rank left waiting in a collective that
  can no longer complete;
- ``ping``: answered at once by the reader thread (``pong``): a rank raised in a cell that
  this one is not in, and the notebook makes sure this one lives before it believes that error;
- ``idle``: every rank has finished the last cell: with a strict ``stall_timeout`` the rank
  reports progress while idle, so that the watchdog judges cells, not the time between them.

Everything the rank sends on the socket is one stream, in order: a cell's output always
arrives before its reply.
"""
from __future__ import annotations

import ast
import builtins
import linecache
import os
import queue
import signal
import socket
import struct
import sys
import threading
import time
from typing import IO, Any, Optional

from ..core.bounds import LINE_CHARS
from ..core.failures import Phase
from ..transfer import pickling
from ..transfer.loading import load
from .context import WorkerContext
from .execute import error_event
from .rank_display import RankDisplay

__all__ = ["serve_session", "send_frame", "encode_frame", "FrameReader", "HEADER", "cell_file_name", "compile_cell"]

HEADER = struct.Struct("!Q")  # each frame: its length, then a pickle
_NONE = object()
_READ = 1 << 16
_FRAMES_SENT = 64  # innermost frames a ``where`` reply carries


def encode_frame(message: dict[str, Any]) -> bytes:
    """``message`` as one frame: its length, then its pickle (cloudpickle, code objects with
    their file names)."""
    data = pickling.dumps(message)
    return HEADER.pack(len(data)) + data


def send_frame(sock: socket.socket, message: dict[str, Any]) -> None:
    """Send ``message`` as one frame."""
    sock.sendall(encode_frame(message))


class FrameReader:
    """Splits what a socket delivers into frames (``feed`` the bytes read, then ``frames()``)."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> None:
        self._buffer += data

    def frames(self) -> list[bytes]:
        out = []
        while len(self._buffer) >= HEADER.size:
            (size,) = HEADER.unpack_from(self._buffer)
            if len(self._buffer) < HEADER.size + size:
                break
            out.append(bytes(self._buffer[HEADER.size:HEADER.size + size]))
            del self._buffer[:HEADER.size + size]
        return out


def cell_file_name(cell: int) -> str:
    """The file name a session cell's code is compiled under (tracebacks show it)."""
    return f"<ddp cell {cell}>"


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


class _Tee:
    """A stream that writes to the rank's own stream (the run records it) and, while a cell runs,
    sends the text to the notebook."""

    def __init__(self, original: IO[str], name: str, send: Any) -> None:
        self.original = original
        self.name = name
        self.send = send

    def write(self, text: str) -> int:
        written = self.original.write(text)
        if text:
            self.send(self.name, text)
        return written

    def flush(self) -> None:
        self.original.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.original, name)


class _Rank:
    def __init__(self, ctx: WorkerContext, sock: socket.socket, heartbeat: Optional[float]) -> None:
        import torch
        import torch.distributed as dist

        self.ctx = ctx
        self.sock = sock
        self.heartbeat = heartbeat
        self.send_lock = threading.Lock()
        self.inbox: queue.Queue[Optional[dict[str, Any]]] = queue.Queue()
        self.cell: Optional[int] = None  # the cell running now
        self.interrupted: Optional[int] = None  # the cell the notebook asked to interrupt
        self.cells_run = 0
        self.replied = False
        self.from_notebook: dict[str, Any] = {}  # what the notebook put in the namespace, by name
        self.display = RankDisplay(self.displayed)
        self.namespace: dict[str, Any] = {
            "__name__": "__ddp_session__", "__builtins__": builtins,
            "rank": ctx.rank, "world_size": ctx.world_size, "ctx": ctx, "torch": torch, "dist": dist,
        }
        if self.display.show is not None:  # as in a notebook, display() needs no import
            self.namespace["display"] = self.display.show

    # ---- talking to the notebook --------------------------------------------------------------
    def send(self, message: dict[str, Any]) -> None:
        message["rank"] = self.ctx.rank
        with self.send_lock:  # a thread the cell started may print while the main thread replies
            send_frame(self.sock, message)
        if message.get("op") in ("done", "error"):
            self.replied = True

    def displayed(self, data: dict[str, Any], metadata: dict[str, Any]) -> None:
        """What the running cell displayed (a bundle): to the notebook, after what it printed."""
        cell = self.cell
        if cell is None:  # a thread of a cell that has ended: its display has no cell to go to
            return
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            self.send({"op": "display", "cell": cell, "data": data, "metadata": metadata})
        except OSError:
            pass

    def take_names(self, names: dict[str, Any]) -> None:
        """Put the notebook's functions, classes and modules the cell names in the namespace,
        except where a cell on this rank bound the name itself: the rank's own is kept."""
        for name, value in names.items():
            if name in self.namespace and self.namespace[name] is not self.from_notebook.get(name, _NONE):
                continue
            self.namespace[name] = self.from_notebook[name] = value

    def output(self, cell: int, stream: str, text: str) -> None:
        try:
            self.send({"op": "out", "cell": cell, "stream": stream, "text": text})
        except OSError:  # the notebook is gone: the lifeline ends this process
            pass

    def read(self) -> None:
        """The reader thread: frames into the inbox; an interrupt is acted on at once."""
        reader = FrameReader()
        while True:
            try:
                data = self.sock.recv(_READ)
            except OSError:
                data = b""
            if not data:
                self.inbox.put(None)
                return
            reader.feed(data)
            for frame in reader.frames():
                message = pickling.loads(frame)
                if message.get("op") == "interrupt":
                    self.interrupt(message.get("cell"))
                elif message.get("op") == "where":
                    self.where(message.get("cell"))
                elif message.get("op") == "ping":  # the notebook settles a failure: this rank lives
                    try:
                        self.send({"op": "pong"})
                    except OSError:
                        pass
                else:
                    self.inbox.put(message)

    def interrupt(self, cell: Any) -> None:
        if cell is not None and cell == self.cell:
            self.interrupted = cell
            signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)

    def where(self, cell: Any) -> None:
        """Send the main thread's frames while ``cell`` runs (innermost first)."""
        if cell is None or cell != self.cell:
            return
        frame = sys._current_frames().get(threading.main_thread().ident or 0)
        frames: list[tuple[str, int, str]] = []
        while frame is not None and len(frames) < _FRAMES_SENT:
            frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
            frame = frame.f_back
        if cell == self.cell:  # still in it (not a frame of the loop between cells)
            try:
                self.send({"op": "where", "cell": cell, "frames": frames, "cpu": time.process_time()})
            except OSError:
                pass

    def on_sigint(self, signum: int, frame: Any) -> None:
        # Only the cell the notebook asked to interrupt is interrupted; a SIGINT at any other
        # time (between cells, a stray Ctrl-C) is ignored: the rank must keep serving.
        if self.cell is not None and self.interrupted == self.cell:
            self.interrupted = None
            raise KeyboardInterrupt

    # ---- serving ------------------------------------------------------------------------------
    def serve(self) -> None:
        idle = False
        while True:
            wait = self.heartbeat if idle and self.heartbeat else None
            try:
                message = self.inbox.get(timeout=wait)
            except queue.Empty:  # every rank idle: say so to the watchdog of a strict stall_timeout
                self.ctx.log(cells=self.cells_run)
                continue
            if message is None or message.get("op") == "close":
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
        try:
            data = pickling.dumps(value)
        except BaseException as exc:  # noqa: BLE001 - a __reduce__ may raise anything (SystemExit): the value stays here
            error = error_event(exc, Phase.RESULT)
            error["message"] = (f"the value could not be sent to the notebook ({type(value).__qualname__}): "
                                f"{error['message']}")
            self.send({"op": "error", "id": message["id"], "error": error})
            return
        self.send({"op": "done", "id": message["id"], "value": data,
                   **({"text": self.display.text(value)} if value is not None else {})})

    def cell_value(self, message: dict[str, Any], value: Any) -> dict[str, Any]:
        """The cell's value as the notebook asked for it: pickled (or why it cannot be), with its
        text; its display bundle when the notebook shows it. Nothing for None."""
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
        self.cells_run += 1
        reply: dict[str, Any] = {}
        failed, failed_at = None, 0.0
        out, err = sys.stdout, sys.stderr
        sys.stdout = _Tee(out, "stdout", lambda stream, text: self.output(cell, stream, text))
        sys.stderr = _Tee(err, "stderr", lambda stream, text: self.output(cell, stream, text))
        try:
            self.cell = cell
            try:
                linecache.cache.update(message.get("sources") or {})  # the notebook's cells, for tracebacks
                self.take_names(pickling.loads(message["names"]))
                body, last = compile_cell(code, filename)
                exec(body, self.namespace)
                value = eval(last, self.namespace) if last is not None else None
                self.display.cell_ended()  # figures drawn in the cell are shown, as IPython shows them
                # Still in the cell: a slow repr can be interrupted, and what it prints is shown.
                reply = self.cell_value(message, value)
            except BaseException as exc:  # noqa: BLE001 - the cell's error, KeyboardInterrupt included, is the reply
                failed, failed_at = exc, time.time()
        finally:
            self.cell = None
            self.interrupted = None
            sys.stdout, sys.stderr = out, err
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        self.ctx.log(cells=self.cells_run)
        if failed is not None:
            self.send({"op": "error", "id": message["id"], "error": _error(failed, failed_at),
                       "interrupted": isinstance(failed, KeyboardInterrupt)})
        else:
            self.send({"op": "done", "id": message["id"], **reply})

def _error(exc: BaseException, when: float) -> dict[str, Any]:
    """The error event of a reply: when it was raised (the first rank to raise is the cause) and,
    for a NameError, the name (the notebook says how to send it when it holds that name)."""
    event = error_event(exc, Phase.RUN)
    event["time"] = when
    if isinstance(exc, NameError) and isinstance(exc.name, str):
        event["name"] = exc.name
    return event


def serve_session(ctx: WorkerContext, address: str, token: str, heartbeat: Optional[float] = None) -> None:
    """A session's rank: connect to the notebook at ``address`` and run what it sends, until it
    says ``close`` (the run then ends, succeeded) or goes (the lifeline ends the process).

    Parameters
    ----------
    ctx : WorkerContext
        The rank's context (the launch makes it).
    address : str
        The notebook's Unix socket.
    token : str
        The session's secret: the first frame says it, so the notebook knows its ranks.
    heartbeat : float, optional
        Seconds between progress reports while every rank is idle (with a strict
        ``stall_timeout``); None: none.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(address)
    rank = _Rank(ctx, sock, heartbeat)
    rank.send({"op": "hello", "token": token, "pid": os.getpid()})
    previous = signal.signal(signal.SIGINT, rank.on_sigint)
    threading.Thread(target=rank.read, name="ddp-session-reader", daemon=True).start()
    try:
        rank.serve()
    finally:
        signal.signal(signal.SIGINT, previous)
        sock.close()
