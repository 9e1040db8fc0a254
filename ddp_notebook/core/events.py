"""Typed events, and the one frame codec that carries them between processes.

An event is a JSON object with at least ``kind`` (an ``EventKind``) and ``time`` (``time.time()``
of the sender). On a pipe each event is one frame: a 4-byte big-endian length, then the JSON. An
event may carry a binary attachment (a pickled return value): its ``blob`` field gives the
attachment's size and the raw bytes follow as the next frame. The same frame carries a worker's
assignment (its ``RankConfig``) the other way. On disk, a run's ``events.jsonl`` holds one
event per line (attachments are not written there).

>>> d = FrameDecoder()
>>> d.feed(encode({"kind": "done", "time": 1.0}) + encode({"kind": "result"}, b"xy"))
[({'kind': 'done', 'time': 1.0}, None), ({'kind': 'result', 'blob': 2}, b'xy')]
"""
from __future__ import annotations

import json
import math
import os
import struct
from typing import Any, Optional, TypedDict

from ._text import TextEnum
from .bounds import METRIC_CHARS, cut

__all__ = ["EventKind", "Control", "SESSION_ROUTED", "DISPLAY_ID", "cell_file_name", "Event", "RankConfig", "encode",
           "FrameDecoder", "read_frame", "write_all", "to_json_value", "NOT_FINITE"]

_LEN = struct.Struct(">I")

Event = dict[str, Any]


class EventKind(TextEnum):
    """What an event says. A worker sends the first group; the supervisor the second."""

    WARM = "warm"  # a worker interpreter has imported torch and waits for its assignment
    STARTED = "started"  # the rank was assigned (pid, main thread id)
    READY = "ready"  # device and process group set up: the function is called now (rank 0: torch's version)
    # ctx.log: step, total, epoch, metrics (the latest values); rank 0's also every value logged
    # since its last report (points: [time, step, epoch, {name: number}] each), and every rank's
    # peak memory (memory: rss, cuda)
    PROGRESS = "progress"
    CHECKPOINT = "checkpoint"  # the main worker saved a checkpoint (epoch, path)
    RETURNED = "returned"  # the function returned; the rank waits for its peers
    DONE = "done"  # the rank's outcome: success (rank 0 attaches its pickled return value)
    ERROR = "error"  # the rank's outcome: an exception (phase, type, message, traceback)
    QUEUE_PUT = "queue_put"  # an item put in a queue of the call (queue: its index; attached: the item)
    # A rank asks a queue of the call (queue, op: get, empty or qsize, id, block, timeout); the
    # notebook answers with a ``queue_answer`` request (id; the item attached, or empty, value, error)
    QUEUE_ASK = "queue_ask"
    MEETING = "meeting"  # rank 0 on an engine serves the run's store (port): the other ranks may start
    ALIVE = "alive"  # a rank on an engine is alive (every second; its host's link is up)
    STACKS = "stacks"  # a rank on an engine dumped its stacks (text), for the stall watchdog
    PONG = "pong"  # a rank's lifeline answers the supervisor's ping: it lives (a failure is being settled)
    # A session's rank answers the notebook (op: hello, out, display, done, error; its
    # body pickled as the attachment): for the session, never an event of the run.
    SESSION = "session"

    # run id, devices, backend, directory, parent, places; what the run was: name, tags, config,
    # origin, cwd, monitor, monitor_mode, code, versions, report_to (core.experiment)
    RUN_STARTED = "run_started"
    PROVENANCE = "provenance"  # what reproduces the run, looked up after its start (git_commit, git_dirty)
    TRACKER = "tracker"  # a tracker of report_to is missing, failed or fell behind (tracker, message)
    # A session's request began: what (cell 3, push lr, pull 'x'), cell (None for a push or a
    # pull), ranks, first_line (of its code), background (run without blocking)
    REQUEST = "request"
    ANSWERED = "answered"  # a rank answered the session's request in flight (status: done, error, interrupted)
    INTERRUPTING = "interrupting"  # the ranks still in the session's request were asked to leave it
    # A session's request ended: cell (None for a push or a pull), what, ranks, status, code,
    # seconds, message, failures, values (each rank's, in words)
    CELL = "cell"
    DATA = "data"  # the call's tensors and arrays being placed for the ranks: bytes sent of total, files
    OUTPUT = "output"  # text a rank printed (stream: stdout or stderr)
    EXITED = "exited"  # a rank ended (exit code, signal, whether the supervisor ended it)
    FAILURE = "failure"  # a WorkerFailure record
    STOPPING = "stopping"  # a stop was asked (reason)
    STALLED = "stalled"  # no progress for stall_timeout: every live rank's stack
    # The run has been quiet a while: where each rank waits or runs (notes: rank -> one line, from
    # its stack and CPU use; none: progress resumed). Never a failure: the watchdog decides that.
    QUIET = "quiet"
    SUPERVISOR_ERROR = "supervisor_error"  # ddp_notebook's supervision itself failed (message)
    RUN_FINISHED = "run_finished"  # the run's status; its record: rank 0's last metrics, the monitored best
    LOG_TRUNCATED = "log_truncated"  # the log on disk reached its limit: later progress and output not written


class Control(TextEnum):
    """What the notebook says to a rank, one frame each on the rank's control pipe, after its
    assignment (``worker.channel.watch_lifeline`` reads them)."""

    STOP = "stop"  # the run asks the rank to stop (ctx.should_stop)
    FLUSH = "flush"  # send the progress report held back by throttling, if any
    RELEASE = "release"  # every rank is done: leave
    # A request (op: ping, answered by the rank's lifeline in every mode; queue_answer, for a
    # queue of the call; a session's run, push, pull, interrupt, idle, close, its body pickled as
    # the attachment, for the session's loop).
    REQUEST = "request"


#: The metadata key under which a session's rank says a display is one it keeps current
#: (``{"id": ..., "update": bool}``: ``display(..., display_id=...)``, ``update_display``).
DISPLAY_ID = "ddp_notebook/display_id"


def cell_file_name(cell: int) -> str:
    """The file name a session cell's code is compiled under (tracebacks show it): the same on
    the ranks and in the notebook (which checks the cell's syntax before sending it)."""
    return f"<ddp cell {cell}>"


#: What a session's request or answer carries in the open, in its frame's JSON: the rest of it
#: travels pickled as the frame's attachment.
SESSION_ROUTED = ("op", "id", "cell", "interrupted")


# Spawn mode: "host:port" of the TCPStore the notebook serves for the function's own rendezvous.
SPAWN_STORE_ENV = "DDP_NOTEBOOK_SPAWN_STORE"


class RankConfig(TypedDict, total=False):
    """One rank's assignment, as the worker process or engine receives it."""

    rank: int
    world_size: int
    local_rank: int  # the rank's index among the ranks on its host
    local_world_size: int  # how many ranks run on its host
    device: str
    backend: str  # torch.distributed backend: gloo or nccl
    run_id: str
    run_dir: str  # paths inside come from core.rundir.RunDir
    timeout: float  # seconds, for the process group's collectives
    threads: int
    sys_path: list[str]
    cwd: str
    env: dict[str, str]
    # Local workers: the notebook's whole environment at launch, which replaces the worker's own
    # (a pooled worker started before a cell changed it). ``env`` applies on top.
    environ: dict[str, str]
    progress_interval: float
    resume_from: Optional[str]  # a checkpoint file to resume from (or a folder: its latest)
    judged: bool  # each epoch's value is judged in the notebook (an Optuna trial): a verdict comes per epoch
    # "context": fn(ctx, ...); "spawn": fn(rank, ...) sets up its own group; "session": the rank
    # serves a session's requests (its call has no function; its args are the loop's)
    mode: str
    # Ranks on engines: where they meet (``worker.meeting``): rank 0's address, the port its store
    # listens on (the other ranks), the run's secret, the address this rank's gloo pairs use
    # (``local``) and the seconds a silent peer host is given (``network_timeout``; several hosts).
    meeting: dict[str, Any]
    # A session's ranks on engines: the store the notebook hosts for its requests (``address``,
    # ``port``; the keys under the meeting's secret, ``worker.channel.watch_requests``).
    requests: dict[str, Any]
    resume_data: bytes  # ranks on engines: the checkpoint to resume from (the notebook read it)
    checkpoints_to_notebook: bool  # ranks on engines: ctx.save_checkpoint sends the checkpoint to the notebook
    data: Optional[dict[str, Any]]  # where the call's shared tensors and arrays are (transfer.packing)
    share_result: bool  # put the main worker's result in shared memory too (a local worker)
    # A local worker's multiprocessing authkey: the notebook's, as torch's spawned children have it,
    # so a Manager's proxies among the arguments connect (sent on the control pipe, never logged).
    authkey: str


def encode(event: dict[str, Any], blob: Optional[bytes] = None) -> bytes:
    """Frame an event (and its attachment) for a pipe."""
    if blob is not None:
        event = dict(event, blob=len(blob))
    data = json.dumps(event, separators=(",", ":"), allow_nan=False, default=str).encode()
    out = _LEN.pack(len(data)) + data
    if blob is not None:
        out += _LEN.pack(len(blob)) + blob
    return out


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, take complete events out."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: Optional[dict[str, Any]] = None  # an event waiting for its attachment

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], Optional[bytes]]]:
        self._buf += data
        out: list[tuple[dict[str, Any], Optional[bytes]]] = []
        while len(self._buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(self._buf)
            if len(self._buf) < _LEN.size + n:
                break
            payload = bytes(self._buf[_LEN.size:_LEN.size + n])
            del self._buf[:_LEN.size + n]
            if self._pending is not None:
                out.append((self._pending, payload))
                self._pending = None
                continue
            event = json.loads(payload)
            if "blob" in event:
                self._pending = event
            else:
                out.append((event, None))
        return out

    @property
    def incomplete(self) -> bool:
        """True when bytes of an unfinished frame are buffered (the sender died mid-write)."""
        return bool(self._buf) or self._pending is not None


def read_frame(fd: int) -> Optional[dict[str, Any]]:
    """Block until one whole frame has arrived on ``fd``; its JSON (None at EOF). An attachment
    (see ``encode``) is read too, and put under ``"blob"`` as bytes."""
    def exact(n: int) -> Optional[bytes]:
        buf = bytearray(n)  # filled in place: appending chunk by chunk is quadratic in the size
        view, got = memoryview(buf), 0
        while got < n:
            try:
                k = os.readv(fd, [view[got:]])
            except OSError:
                return None
            if not k:
                return None
            got += k
        return bytes(buf)

    head = exact(_LEN.size)
    body = exact(_LEN.unpack(head)[0]) if head else None
    if not body:
        return None
    event: dict[str, Any] = json.loads(body)
    if "blob" in event:
        size = exact(_LEN.size)
        blob = exact(_LEN.unpack(size)[0]) if size else None
        if blob is None and event["blob"]:
            return None  # cut off: the sender is gone
        event["blob"] = blob or b""
    return event


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (pipes may accept partial writes)."""
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


NOT_FINITE = ("nan", "inf", "-inf")
"""How ``to_json_value`` writes a non-finite number (JSON has none): what reads it turns it back."""


def to_json_value(value: Any, name: str = "value") -> Any:
    """A metric value as JSON: numbers, strings, bools; tensors and numpy scalars via .item().

    NaN and infinities become strings ("nan", "inf") so the log stays valid JSON; a string is cut
    at ``bounds.METRIC_CHARS``.
    """
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError) as e:
            raise TypeError(f"metric {name!r} must be a number or a one-element tensor: {e}") from None
    if isinstance(value, str):
        return cut(value, METRIC_CHARS)  # cut where it is logged: a huge string never crosses the pipe
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        try:
            float(value)
        except OverflowError:  # beyond any float: shown as the infinity it is to a plot
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    raise TypeError(f"metric {name!r} must be a number or a string, not {type(value).__name__}")
