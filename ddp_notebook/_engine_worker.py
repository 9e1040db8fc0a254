"""What runs inside an ipyparallel engine for one rank of a run (sent there by ``engines.py``).

An engine is a long-lived process that belongs to the user's cluster: unlike a worker
process it is not ours to end. So one rank here leaves the engine as it found it: the
process group destroyed (which is also what makes peers blocked in a collective fail at
once instead of waiting out the timeout), environment, working directory, thread count and
signal handlers restored.

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

from ._worker import Phase, _error_event, execute

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


class RunDirNotVisible(RuntimeError):
    """The engine cannot see the run directory, where the process group meets."""


def run_rank(cfg: dict, payload: bytes) -> dict:
    """Run one rank on this engine; returns ``{"kind": "done", "blob": ...}`` or an error event."""
    out = _Publisher(cfg["rank"])
    stop = threading.Event()
    interrupted = threading.Event()

    def on_interrupt(signum: int, frame: Any) -> None:
        interrupted.set()
        raise KeyboardInterrupt

    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_int = signal.signal(signal.SIGINT, on_interrupt)
    signal.signal(signal.SIGUSR2, lambda signum, frame: stop.set())
    stack_file = open(cfg["stack_file"], "w") if os.path.isdir(cfg["run_dir"]) else None
    if stack_file is not None:
        # A late SIGUSR1 must not end an idle engine: ignored once the handler is gone.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
    threads = _torch_threads()
    out.send({"kind": "started", "pid": os.getpid(), "host": socket.gethostname(),
              "main_thread": threading.get_ident()})
    where = Phase()
    try:
        if stack_file is None:
            raise RunDirNotVisible(
                f"this engine (host {socket.gethostname()}) cannot see the run directory {cfg['run_dir']}, where "
                "the workers meet: pass run_root= a directory that every engine sees (a shared file system)")
        blob = execute(cfg, payload, out.send, stop, where)
        return {"kind": "done", "time": time.time(), "blob": blob}
    except BaseException as exc:  # noqa: BLE001 - every failure is reported, the engine lives on
        event = _error_event(exc, where.name)
        event.update(time=time.time(), interrupted=interrupted.is_set())
        return event
    finally:
        _leave(saved_env, saved_cwd, threads)
        if stack_file is not None:
            faulthandler.unregister(signal.SIGUSR1)
            stack_file.close()
        # A stop request that arrives after the function ended is ignored, never fatal.
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        signal.signal(signal.SIGINT, saved_int)
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass


def _torch_threads() -> Optional[int]:
    try:
        import torch

        return torch.get_num_threads()
    except Exception:  # noqa: BLE001
        return None


def _leave(env: dict, cwd: str, threads: Optional[int]) -> None:
    """Give the engine back as it was (the process group is what matters most: see above)."""
    try:
        from . import _teardown

        _teardown.release()
    except Exception:  # noqa: BLE001 - a broken group is gone either way
        pass
    from . import context

    context._current = None
    os.environ.clear()
    os.environ.update(env)
    try:
        os.chdir(cwd)
    except OSError:
        pass
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
