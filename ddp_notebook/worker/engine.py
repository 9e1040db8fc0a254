"""What an ipyparallel engine runs for a run: ``describe_engine`` (for validation) and
``run_rank`` (one rank; the engine's ``main``).

A rank leaves the engine as it found it (``engine_state``); STACK_SIGNAL/SIGUSR2 are ignored from
then on, so a late request cannot end an idle engine; an engine that already holds a process
group of its own is refused, never touched. Events travel as ipyparallel data messages
(``channel.DataChannel``); the result, or the error event, is the return value of the call. The
ranks meet in a store rank 0's call hosts (``meeting``); nothing needs a shared file system.
Signals from the notebook (through ipyparallel's nanny): SIGUSR2 sets ``ctx.should_stop``,
SIGINT interrupts the function, STACK_SIGNAL dumps the stacks for the stall watchdog. A session's
rank also reads the notebook's requests from a store the notebook hosts (``channel.watch_requests``).
"""
from __future__ import annotations

import gc
import os
import signal
import socket
import tempfile
import threading
import time
from typing import Any, Optional

from ..core.events import EventKind, RankConfig
from ..core.version import __version__
from .boot import STACK_SIGNAL
from .channel import DataChannel, watch_requests
from .context import peak_memory
from .engine_state import EngineSnapshot
from .execute import Where, execute, flush_std, install_stack_dump, remove_stack_dump
from .failure_event import error_event
from .meeting import Meeting, RunEndedError
from .network import interfaces, machine_key
from .pulse import Pulse

__all__ = ["describe_engine", "run_rank", "EngineNotReady", "REQUESTS_CONNECT"]

REQUESTS_CONNECT = 15.0  # seconds a session's rank tries to reach the notebook's request store


class EngineNotReady(RuntimeError):
    """The engine cannot take this rank (it already holds a process group of its own)."""


def describe_engine() -> dict[str, Any]:
    """What validation needs to know about an engine (called there before a run)."""
    info: dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "cpu_count": os.cpu_count() or 1,
                            "machine": machine_key(), "addresses": interfaces()}
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
    rank, world_size = cfg["rank"], cfg["world_size"]
    out = DataChannel(rank)
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
    # A late stack signal must not end an idle engine: ignored once the handler is gone. The
    # stacks go to a file of this host's, and from there to the notebook (``Pulse``).
    signal.signal(STACK_SIGNAL, signal.SIG_IGN)
    fd, stack_path = tempfile.mkstemp(prefix=f"ddp-notebook-stacks-rank{rank}-")  # owner-only
    # Unlinked at once, read through this descriptor: an engine killed mid-run leaves no file behind.
    stacks = install_stack_dump(stack_path)
    os.unlink(stack_path)
    meeting_cfg = cfg["meeting"]
    _take_requests(cfg, out, stop)
    pulse = Pulse(rank, world_size, out.send, fd, network_timeout=meeting_cfg.get("network_timeout"))
    pulse.start()
    out.send({"kind": EventKind.STARTED, "pid": os.getpid(), "host": socket.gethostname(),
              "main_thread": threading.get_ident()})
    where = Where()
    meeting: Optional[Meeting] = None
    try:
        try:
            if saved.had_group:
                raise EngineNotReady("this engine already holds a torch.distributed process group of its own; "
                                     "destroy it there (dist.destroy_process_group()) or choose other engines")
            meeting = _meet(cfg, out)
            result = execute(cfg, payload, out.send, stop, where, meeting, pulse.watch)
            blob = result.inline() if result is not None else None
        except BaseException as exc:  # noqa: BLE001 - every failure is reported, the engine lives on
            armed.clear()
            # Peers waiting for this rank (to start, or to leave together) need not wait any more.
            if meeting is not None:
                meeting.end()
            event = error_event(exc, where.phase)
            event.update(time=time.time(), interrupted=interrupted.is_set())
            unreachable = pulse.unreachable()
            if unreachable:  # this rank's collective failed because a peer's host was cut off
                event.update(knock_on=True, unreachable={str(r): why for r, why in unreachable.items()})
            return event
        out.send({"kind": EventKind.RETURNED})
        try:
            # Like a worker process, stay until every rank has returned: leaving now would
            # destroy the group under a peer still in its last collective.
            meeting.arrive("returned", rank, world_size, cfg["timeout"])
        except BaseException:  # noqa: BLE001 - interrupted, a peer failed, or the run ended: the result stands
            pass
        armed.clear()
        return {"kind": EventKind.DONE, "time": time.time(), "blob": blob, "memory": peak_memory()}
    finally:
        armed.clear()
        out.close()
        pulse.stop()
        saved.restore()
        remove_stack_dump(stacks)
        os.close(fd)
        if meeting is not None:
            meeting.close()  # rank 0's store stops serving: a peer still waiting on it leaves
        # The group and the store may still be held by a cycle (an error's traceback and its
        # frames): collected now, their sockets close with the run, not at the engine's next
        # collection, which an idle engine may not make for a long time.
        gc.collect()
        # A stop request that arrives after the function ended is ignored, never fatal.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGINT, saved_int)
        flush_std()


def _take_requests(cfg: RankConfig, out: DataChannel, stop: threading.Event) -> None:
    """A session's rank: read the notebook's requests from the store the notebook hosts, on a
    thread of its own (until the notebook says the run is over, or goes). An engine that cannot
    reach it says so to the session's loop (``DataChannel.unreachable``)."""
    where = cfg.get("requests")
    if not where:  # (only a session's ranks take requests on engines: a trial's verdicts do not come)
        out.unreachable = f"rank {cfg['rank']}'s engine takes no requests from the notebook in this run"
        return
    try:
        requests = Meeting.join(str(where["address"]), int(where["port"]), cfg["meeting"]["secret"], cfg["timeout"],
                                connect=REQUESTS_CONNECT, host="the notebook, where a session's requests come from")
    except RunEndedError as e:
        out.unreachable = f"rank {cfg['rank']}'s engine: {e}"
        return
    threading.Thread(target=watch_requests, args=(requests.store, cfg["rank"], stop), name="ddp-requests",
                     daemon=True).start()


def _meet(cfg: RankConfig, out: DataChannel) -> Meeting:
    """Rank 0 hosts the run's store and announces its port (the notebook passes it on to the
    other ranks' calls); the others join it. Each says which address its gloo pairs use."""
    m = cfg["meeting"]
    if cfg["rank"] == 0:
        meeting = Meeting.host(m["address"], m["secret"], cfg["timeout"])
        out.send({"kind": EventKind.MEETING, "port": meeting.port})
    else:
        meeting = Meeting.join(m["address"], int(m["port"]), m["secret"], cfg["timeout"])
    meeting.store.set(f"address/{cfg['rank']}", m.get("local") or m["address"])
    return meeting
