"""What an ipyparallel engine runs for a run: ``describe_engine`` (for validation) and
``run_rank`` (one rank; the engine's ``main``).

A rank leaves the engine as it found it (``engine_state``); STACK_SIGNAL/SIGUSR2 are ignored from
then on, so a late request cannot end an idle engine; an engine that already holds a process
group of its own is refused, never touched. Events travel as ipyparallel data messages
(``channel.DataChannel``); the result, or the error event, is the return value of the call.
Signals from the notebook (through ipyparallel's nanny): SIGUSR2 sets ``ctx.should_stop``,
SIGINT interrupts the function, STACK_SIGNAL dumps the stacks for the stall watchdog.
"""
from __future__ import annotations

import os
import signal
import socket
import threading
import time
from typing import IO, Any, Optional

from ..core.events import EventKind, RankConfig
from ..core.rundir import RunDir
from ..core.version import __version__
from .boot import STACK_SIGNAL
from .channel import DataChannel
from .engine_state import EngineSnapshot
from .execute import Where, error_event, execute, flush_std, install_stack_dump, remove_stack_dump
from .peers import await_peers

__all__ = ["describe_engine", "run_rank", "EngineNotReady"]


class EngineNotReady(RuntimeError):
    """The engine cannot take this rank (it cannot see the run directory, or already holds a
    process group of its own)."""


def describe_engine() -> dict[str, Any]:
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
    info["ddp_notebook"] = __version__
    return info


def run_rank(cfg: RankConfig, payload: bytes) -> dict[str, Any]:
    """Run one rank on this engine; returns ``{"kind": "done", "blob": ...}`` or an error event."""
    out = DataChannel(cfg["rank"])
    directory = RunDir(cfg["run_dir"])
    stop = threading.Event()
    interrupted = threading.Event()  # the notebook interrupted this rank
    armed = threading.Event()  # an interrupt raises (only while the function runs or waits)
    armed.set()

    def on_interrupt(signum: int, frame: Any) -> None:
        interrupted.set()
        if armed.is_set():  # once: reporting and clean-up must not be interrupted
            armed.clear()
            raise KeyboardInterrupt

    saved = EngineSnapshot()
    saved_int = signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGUSR2, lambda signum, frame: stop.set())
    stacks: Optional[IO[str]] = None
    if os.path.isdir(directory.path):
        # A late stack signal must not end an idle engine: ignored once the handler is gone.
        signal.signal(STACK_SIGNAL, signal.SIG_IGN)
        stacks = install_stack_dump(directory.stack_file(cfg["rank"]))
    out.send({"kind": EventKind.STARTED, "pid": os.getpid(), "host": socket.gethostname(),
              "main_thread": threading.get_ident()})
    where = Where()
    try:
        try:
            if stacks is None:
                raise EngineNotReady(
                    f"this engine (host {socket.gethostname()}) cannot see the run directory {directory.path}, "
                    "where the workers meet: pass run_root= a directory that every engine sees (a shared file system)")
            if saved.had_group:
                raise EngineNotReady("this engine already holds a torch.distributed process group of its own; "
                                     "destroy it there (dist.destroy_process_group()) or choose other engines")
            result = execute(cfg, payload, out.send, stop, where)
            blob = result.inline() if result is not None else None
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, the engine lives on
            armed.clear()
            # Peers waiting for this rank (to start, or to leave together) need not wait any more.
            directory.mark_ended()
            event = error_event(exc, where.phase)
            event.update(time=time.time(), interrupted=interrupted.is_set())
            return event
        out.send({"kind": EventKind.RETURNED})
        try:
            # Like a worker process, stay until every rank has returned: leaving now would
            # destroy the group under a peer still in its last collective.
            await_peers(directory.returned_dir, directory, cfg["rank"], cfg["world_size"], cfg["timeout"])
        except BaseException:  # noqa: BLE001 - interrupted, a peer failed, or the run ended: the result stands
            pass
        armed.clear()
        return {"kind": EventKind.DONE, "time": time.time(), "blob": blob}
    finally:
        armed.clear()
        saved.restore()
        if stacks is not None:
            remove_stack_dump(stacks)
        # A stop request that arrives after the function ended is ignored, never fatal.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGINT, saved_int)
        flush_std()
