"""What runs inside an ipyparallel engine for one rank of a run (sent there by ``engines.py``).

An engine is a long-lived process that belongs to the user's cluster: unlike a worker
process it is not ours to end. So one rank here leaves the engine as it found it: the
process group destroyed (which is also what makes peers blocked in a collective fail at
once instead of waiting out the timeout); environment, sys.path, working directory, thread
count, current GPU and SIGINT handling restored; SIGUSR1/SIGUSR2 ignored from then on, so a
late request cannot end an idle engine. An engine that already holds a process group of its
own is refused, never touched.

Events travel as ipyparallel data messages (``publish_data``) under increasing keys; the
notebook reads and removes them in key order. The result, or the error event, is the return
value of the call. Signals from the notebook (through ipyparallel's nanny): SIGUSR2 sets
``ctx.should_stop``, SIGINT interrupts the function, SIGUSR1 dumps the stacks for the stall
watchdog.
"""
from __future__ import annotations

import faulthandler
import itertools
import os
import signal
import socket
import sys
import threading
import time
from typing import Any, Optional

from ._worker import Phase, _await_peers, _error_event, _flush_std, execute, mark_ended

__all__ = ["describe_engine", "run_rank"]


def describe_engine() -> dict:
    """What validation needs to know about an engine (called there before a run)."""
    info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "cpu_count": os.cpu_count() or 1}
    try:
        import torch

        info["torch"] = torch.__version__
        # Only look: creating a CUDA context here would hold GPU memory in the user's engine.
        info["cuda_count"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
        info["nccl"] = bool(torch.distributed.is_nccl_available())
        # Engines pinned to one GPU each see it as cuda:0: validation needs the physical ids.
        info["cuda_visible"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    except Exception as e:  # noqa: BLE001 - reported as a finding by validation
        info["torch_error"] = f"{type(e).__name__}: {e}"
    from . import __version__

    info["ddp_notebook"] = __version__
    return info


class _Publisher:
    """``send(event)`` as ordered ipyparallel data messages (thread-safe)."""

    def __init__(self, rank: int) -> None:
        from ipyparallel.datapub import publish_data

        self._publish = publish_data
        self._rank = rank
        self._seq = itertools.count()
        self._lock = threading.Lock()

    def send(self, event: dict, blob: Optional[bytes] = None) -> None:
        event.setdefault("rank", self._rank)
        event.setdefault("time", time.time())
        with self._lock:
            self._publish({f"{next(self._seq):012d}": event})


class EngineNotReady(RuntimeError):
    """The engine cannot take this rank (it cannot see the run directory, or already holds a
    process group of its own)."""


def run_rank(cfg: dict, payload: bytes) -> dict:
    """Run one rank on this engine; returns ``{"kind": "done", "blob": ...}`` or an error event."""
    out = _Publisher(cfg["rank"])
    stop = threading.Event()
    interrupted = threading.Event()  # the notebook interrupted this rank
    armed = threading.Event()  # an interrupt raises (only while the function runs or waits)
    armed.set()

    def on_interrupt(signum: int, frame: Any) -> None:
        interrupted.set()
        if armed.is_set():  # once: reporting and clean-up must not be interrupted
            armed.clear()
            raise KeyboardInterrupt

    saved = _Saved()
    saved_int = signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGUSR2, lambda signum, frame: stop.set())
    stack_file = open(cfg["stack_file"], "w") if os.path.isdir(cfg["run_dir"]) else None
    if stack_file is not None:
        # A late SIGUSR1 must not end an idle engine: ignored once the handler is gone.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    out.send({"kind": "started", "pid": os.getpid(), "host": socket.gethostname(),
              "main_thread": threading.get_ident()})
    where = Phase()
    try:
        try:
            if stack_file is None:
                raise EngineNotReady(
                    f"this engine (host {socket.gethostname()}) cannot see the run directory {cfg['run_dir']}, "
                    "where the workers meet: pass run_root= a directory that every engine sees (a shared file system)")
            if saved.had_group:
                raise EngineNotReady("this engine already holds a torch.distributed process group of its own; "
                                     "destroy it there (dist.destroy_process_group()) or choose other engines")
            blob = execute(cfg, payload, out.send, stop, where)
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, the engine lives on
            armed.clear()
            # Peers waiting for this rank (to start, or to leave together) need not wait any more.
            mark_ended(cfg["run_dir"])
            event = _error_event(exc, where.name)
            event.update(time=time.time(), interrupted=interrupted.is_set())
            return event
        out.send({"kind": "returned"})
        try:
            # Like a worker process, stay until every rank has returned: leaving now would
            # destroy the group under a peer still in its last collective.
            _await_peers(cfg["returned"], cfg["rank"], cfg["world_size"], cfg["timeout"])
        except BaseException:  # noqa: BLE001 - interrupted, a peer failed, or the run ended: the result stands
            pass
        armed.clear()
        return {"kind": "done", "time": time.time(), "blob": blob}
    finally:
        armed.clear()
        saved.restore()
        if stack_file is not None:
            faulthandler.unregister(signal.SIGUSR1)
            stack_file.close()
        # A stop request that arrives after the function ended is ignored, never fatal.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGINT, saved_int)
        _flush_std()


class _Saved:
    """What a rank changes in the engine, as it was before (restored by ``restore``)."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        self.env, self.cwd, self.sys_path = dict(os.environ), os.getcwd(), list(sys.path)
        self.threads = torch.get_num_threads()
        self.had_group = dist.is_available() and dist.is_initialized()
        self.cuda_device = torch.cuda.current_device() if torch.cuda.is_initialized() else None

    def restore(self) -> None:
        """Give the engine back as it was; the process group goes first (see the module doc).
        Never raises: the rank's result or error must still reach the notebook."""
        import torch

        from . import _teardown, context

        if not self.had_group:
            try:
                _teardown.release()
            except BaseException:  # noqa: BLE001 - a broken group is gone either way
                pass
        context._current = None
        os.environ.clear()
        os.environ.update(self.env)
        sys.path[:] = self.sys_path
        try:
            os.chdir(self.cwd)
        except OSError:
            pass
        torch.set_num_threads(self.threads)
        if self.cuda_device is not None:  # never create a CUDA context the engine did not have
            try:
                torch.cuda.set_device(self.cuda_device)
            except Exception:  # noqa: BLE001 - a broken device stays broken; the report matters more
                pass


