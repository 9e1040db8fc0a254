"""The worker process: ``python -m ddp_notebook._worker`` (started by ddp_notebook only).

It imports torch first, then waits for its assignment (rank, device, run) on its control
pipe, so a pool can keep such processes warm between runs. It reports to the supervisor over an inherited pipe (never a socket), watches a second pipe
as its lifeline (EOF = the notebook is gone: exit at once), sets up the process group from a
file rendezvous, runs the function, and leaves with ``os._exit`` once the supervisor has its
result, so interpreter teardown can neither hang nor turn a success into a failure.
"""
from __future__ import annotations

import faulthandler
import json
import linecache
import os
import signal
import struct
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

from .stall import is_runner_file
from .wire import encode, write_all

CONFIG_ENV = "DDP_NOTEBOOK_WORKER"
EXIT_FAILED = 1
EXIT_ORPHANED = 75  # the supervisor went away
ENDED_MARK = "ended"  # a file in the run directory once the notebook has finished the run


class _Channel:
    """Thread-safe frame writer to the supervisor; a broken pipe means the notebook is gone."""

    def __init__(self, fd: int, rank: int) -> None:
        self.fd = fd
        self.rank = rank
        self._lock = threading.Lock()

    def send(self, event: dict, blob: Optional[bytes] = None) -> None:
        event.setdefault("rank", self.rank)
        event.setdefault("time", time.time())
        data = encode(event, blob)
        with self._lock:
            try:
                write_all(self.fd, data)
            except OSError:
                os._exit(EXIT_ORPHANED)


def _watch_lifeline(fd: int, stop: threading.Event, release: threading.Event) -> None:
    while True:
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if not data:
            os._exit(EXIT_ORPHANED)
        if b"s" in data:
            stop.set()
        if b"x" in data:
            release.set()
            return




def _error_event(exc: BaseException, phase: str) -> dict:
    # The first frames are this package's runner (main(), execute()): users need their own only.
    tb_head = exc.__traceback__
    while tb_head is not None and tb_head.tb_next is not None and is_runner_file(tb_head.tb_frame.f_code.co_filename):
        tb_head = tb_head.tb_next
    exc.__traceback__ = tb_head
    tb = traceback.TracebackException.from_exception(exc)
    frames = [{"file": f.filename, "line": f.lineno, "name": f.name} for f in tb.stack]
    return {
        "kind": "error",
        "phase": phase,
        "exc_type": type(exc).__qualname__,
        "exc_module": type(exc).__module__,
        "message": str(exc),
        "traceback": "".join(tb.format()),
        "frames": frames,
    }


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def _warm_up(preload_dynamo: bool) -> None:
    """Import what every run needs before a run is assigned: a pooled worker pays this ahead."""
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    if preload_dynamo:
        # DistributedDataParallel imports torch._dynamo on first use (about 1 s on a small
        # machine): a pooled worker imports it while idle; a cold one only if the run needs it.
        import torch._dynamo  # noqa: F401


def _read_config(fd: int) -> Optional[dict]:
    """The run's assignment: one length-prefixed JSON frame on the control pipe (None at EOF)."""
    def exact(n: int) -> Optional[bytes]:
        buf = b""
        while len(buf) < n:
            try:
                chunk = os.read(fd, n - len(buf))
            except OSError:
                return None
            if not chunk:
                return None
            buf += chunk
        return buf

    head = exact(4)
    body = exact(struct.unpack(">I", head)[0]) if head else None
    return json.loads(body) if body else None


class Phase:
    """Where a worker is (startup, unpickle, init, run, result): error events say it."""

    name = "startup"


def execute(cfg: dict, payload: bytes, send: Callable[..., None], stop: threading.Event, where: Phase) -> Optional[bytes]:
    """Set up the rank described by ``cfg``, run the packed call and return the main worker's
    pickled result (None on other ranks). Raises whatever the set-up or the function raised,
    with ``where.name`` saying in which phase. Shared by worker processes and ipyparallel engines."""
    rank, world_size = cfg["rank"], cfg["world_size"]
    ctx = None
    try:
        os.environ.update(cfg.get("env", {}))
        for key, value in {"RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": cfg.get("local_rank", rank),
                           "LOCAL_WORLD_SIZE": cfg.get("local_world_size", world_size)}.items():
            os.environ[key] = str(value)
        if cfg.get("cwd") and os.path.isdir(cfg["cwd"]):  # an engine on another host may not have it
            os.chdir(cfg["cwd"])
        for p in reversed(cfg.get("sys_path", [])):
            if p not in sys.path:
                sys.path.insert(0, p)
        from . import pickling
        import torch
        import torch.distributed as dist

        if cfg.get("threads"):
            torch.set_num_threads(int(cfg["threads"]))

        from . import _teardown

        # Before unpickling: code that binds destroy_process_group by name while it is imported
        # must bind the version that defers the group's destruction.
        _teardown.hold()
        where.name = "unpickle"
        call = pickling.loads(payload)
        # Sources of notebook cells, so tracebacks in the worker show the lines of cell code.
        linecache.cache.update(call.get("sources", {}))
        fn, args, kwargs = call["fn"], call["args"], call["kwargs"]

        where.name = "init"
        kind, index = cfg["device"].split(":")
        if kind == "cuda":
            torch.cuda.set_device(int(index))
            device = torch.device("cuda", int(index))
        else:
            device = torch.device("cpu")
        import datetime

        if cfg.get("arrivals"):
            _await_peers(cfg["arrivals"], rank, world_size, cfg.get("timeout"))
        spawn_mode = cfg.get("mode") == "spawn"  # fn(rank, ...) sets up its own process group
        if not spawn_mode:
            dist.init_process_group(
                backend=cfg["backend"], init_method="file://" + cfg["init_file"], rank=rank,
                world_size=world_size, timeout=datetime.timedelta(seconds=cfg["timeout"]),
                **({"device_id": device} if kind == "cuda" else {}),
            )
            _teardown.keep(dist.group.WORLD)

        from . import context
        from .context import WorkerContext

        ctx = WorkerContext(
            rank=rank, world_size=world_size, device=device, device_name=cfg["device"],
            backend=cfg["backend"], run_id=cfg["run_id"], run_dir=cfg["run_dir"], send=send,
            stop_event=stop, progress_interval=cfg.get("progress_interval", 0.1),
            resume_from=cfg.get("resume_from"),
        )
        context._current = ctx
        send({"kind": "ready"})
        where.name = "run"
        result = fn(rank, *args, **kwargs) if spawn_mode else fn(ctx, *args, **kwargs)
        ctx.flush()
        where.name = "result"
        return pickling.dumps(result) if rank == 0 else None
    except BaseException:
        if ctx is not None:
            ctx.flush()  # the last progress before the failure, for the panel and the report
        raise


def mark_ended(run_dir: str) -> None:
    """Tell every rank still waiting in ``_await_peers`` that the run is over."""
    try:
        with open(os.path.join(run_dir, ENDED_MARK), "w"):
            pass
    except OSError:
        pass


def _await_peers(folder: str, rank: int, world_size: int, timeout: Optional[float] = None) -> None:
    """Wait, in Python, until every rank got this far.

    Used where a worker cannot be killed (an ipyparallel engine): torch's rendezvous waits in
    C++, where an interrupt is not seen, so a rank whose peer failed before the rendezvous
    would otherwise wait out the whole timeout. Here it stays interruptible."""
    ended = os.path.join(os.path.dirname(folder), ENDED_MARK)
    deadline = time.monotonic() + timeout if timeout else None
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, str(rank)), "w"):
        pass
    while len(os.listdir(folder)) < world_size:
        if os.path.exists(ended):  # a peer failed, or this task started after its run was over
            raise RuntimeError("the run ended before every rank got this far")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"not every rank got this far within {timeout:.0f} s")
        time.sleep(0.01)


def main() -> None:
    boot: dict[str, Any] = json.loads(os.environ.pop(CONFIG_ENV))
    # Segfaults and aborts print the Python stack to stderr, which the supervisor captures.
    faulthandler.enable(file=sys.stderr, all_threads=True)
    warm_error: Optional[BaseException] = None
    try:
        _warm_up(bool(boot.get("pooled")))
    except BaseException as e:  # noqa: BLE001 - reported once the worker knows its rank
        warm_error = e
    # Tell whoever holds this process that it is warm (the pool looks, the run logs it).
    write_all(boot["event_fd"], encode({"kind": "warm", "rank": -1, "pid": os.getpid(), "time": time.time()}))
    cfg = _read_config(boot["control_fd"])
    if cfg is None:  # the pool was shut down, or the notebook is gone
        os._exit(EXIT_ORPHANED)
    channel = _Channel(boot["event_fd"], cfg["rank"])
    stop, release = threading.Event(), threading.Event()
    threading.Thread(target=_watch_lifeline, args=(boot["control_fd"], stop, release),
                     name="ddp-lifeline", daemon=True).start()
    # SIGUSR1 dumps every thread's stack into a file: the stall watchdog reads it.
    stack_file = open(cfg["stack_file"], "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    channel.send({"kind": "started", "pid": os.getpid(), "main_thread": threading.get_ident()})

    where = Phase()
    try:
        if warm_error is not None:
            raise warm_error
        with open(cfg["payload"], "rb") as f:
            payload = f.read()
        blob = execute(cfg, payload, channel.send, stop, where)
        channel.send({"kind": "done"}, blob)
    except BaseException as exc:  # noqa: BLE001 - every failure, SystemExit included, is reported
        channel.send(_error_event(exc, where.name))
        _flush_std()
        os._exit(EXIT_FAILED)
    # Stay until every rank is done: a rank leaving early could cut a peer's last collective.
    release.wait()
    _flush_std()
    os._exit(0)


if __name__ == "__main__":
    main()
