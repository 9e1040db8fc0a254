"""Running one rank of a run: set up, call the function, return its result.

Shared by worker processes (``process``) and ipyparallel engines (``engine``): the environment,
``sys.path`` and threads of the rank, unpickling the call, the device and the process group (a
file rendezvous, or the ``Meeting`` of ranks on engines), the ``WorkerContext``, the call itself
and the pickled result. Failures are raised with ``where.phase`` saying how far the rank got;
``failure_event.error_event`` turns them into the event the supervisor makes a ``WorkerFailure`` of.
"""
from __future__ import annotations

import datetime
import faulthandler
import linecache
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import IO, Any, Optional

from ..core.events import EventKind, RankConfig
from ..core.failures import Phase
from ..core.rundir import RunDir
from ..transfer import loading, packing, pickling
from ..transfer.packing import Packed
from . import context, own_init, teardown
from .boot import STACK_SIGNAL
from .context import WorkerContext
from .frameworks.hooks import watch_imports
from .meeting import Meeting
from .spawn_store import join_notebook_store

__all__ = ["Where", "execute", "flush_std", "warm_up", "install_stack_dump", "remove_stack_dump"]


class Where:
    """How far a rank got (its ``Phase``): error events say it."""

    phase: Phase = Phase.STARTUP


def warm_up(preload_dynamo: bool) -> None:
    """Import what every run needs before a run is assigned: a pooled worker pays this ahead."""
    import cloudpickle  # noqa: F401
    import torch
    import torch.distributed

    if preload_dynamo:
        # DistributedDataParallel imports torch._dynamo on first use (about 1 s on a small
        # machine): a pooled worker imports it while idle; a cold one only if the run needs it.
        import torch._dynamo  # noqa: F401


def install_stack_dump(path: str) -> IO[str]:
    """``STACK_SIGNAL`` dumps every thread's Python stack into ``path`` (the stall watchdog reads
    it); faulthandler writes even while the main thread is blocked in C code."""
    # Owner-only and never through a link, like every file of the run.
    stack_file = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0), 0o600), "w")
    faulthandler.register(STACK_SIGNAL, file=stack_file, all_threads=True)
    return stack_file


def remove_stack_dump(stack_file: IO[str]) -> None:
    faulthandler.unregister(STACK_SIGNAL)
    stack_file.close()


def launched_env(cfg: RankConfig) -> dict[str, str]:
    """What torchrun sets in a worker's environment, which the frameworks read to know they were
    launched from outside (Lightning's ``TorchElasticEnvironment``, accelerate, Hugging Face)
    and so join the process group instead of starting processes of their own."""
    rank, world_size = cfg["rank"], cfg["world_size"]
    local_rank, local_world_size = cfg.get("local_rank", rank), cfg.get("local_world_size", world_size)
    return {key: str(value) for key, value in {
        "RANK": rank, "WORLD_SIZE": world_size, "LOCAL_RANK": local_rank, "LOCAL_WORLD_SIZE": local_world_size,
        "GROUP_RANK": rank // max(local_world_size, 1), "GROUP_WORLD_SIZE": -(-world_size // max(local_world_size, 1)),
        "ROLE_NAME": "default", "ROLE_RANK": rank, "ROLE_WORLD_SIZE": world_size,
        "TORCHELASTIC_RUN_ID": cfg["run_id"], "TORCHELASTIC_RESTART_COUNT": 0, "TORCHELASTIC_MAX_RESTARTS": 0,
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
    }.items()}


def execute(cfg: RankConfig, payload: bytes, send: Callable[..., None], stop: threading.Event,
            where: Where, meeting: Optional[Meeting] = None,
            arrived: Optional[Callable[[Meeting], None]] = None) -> Optional[Packed]:
    """Set up the rank described by ``cfg``, run the packed call and return the main worker's
    packed result (None on other ranks): its large tensors and arrays by reference when
    ``cfg["share_result"]``, else all by value. Raises whatever the set-up or the function
    raised, with ``where.phase`` saying in which phase. With a ``meeting`` (ranks on engines)
    the ranks first wait for each other in Python (then ``arrived(meeting)``) and the process
    group meets in its store; without, in the run directory's rendezvous file."""
    rank, world_size = cfg["rank"], cfg["world_size"]
    directory = RunDir(cfg["run_dir"])
    ctx = None
    # The bytecode cache of the user's modules stays as the notebook wrote it: it is how the
    # notebook sees a module edited after its import (``lifecycle.stale_code``).
    sys.dont_write_bytecode = True
    try:
        if "environ" in cfg:
            os.environ.clear()
            os.environ.update(cfg["environ"])
        os.environ.update(cfg.get("env", {}))
        if hasattr(time, "tzset"):
            time.tzset()  # TZ as the notebook has it (a pooled or forked worker read it earlier)
        os.environ.update(launched_env(cfg))
        cwd = cfg.get("cwd")
        if cwd and os.path.isdir(cwd):  # an engine on another host may not have it
            os.chdir(cwd)
        for p in reversed(cfg.get("sys_path", [])):
            if p not in sys.path:
                sys.path.insert(0, p)
        import torch
        import torch.distributed as dist

        if cfg.get("threads"):
            torch.set_num_threads(int(cfg["threads"]))

        # Before unpickling: code that binds destroy_process_group by name while it is imported
        # must bind the version that defers the group's destruction.
        teardown.hold()
        # A function's own init_process_group (torchrun-style code) joins the run's group, or is
        # refused at once when it could never meet.
        own_init.check_own_init(rank, world_size, cfg["device"], spawn_mode=cfg.get("mode") == "spawn")
        watch_imports()  # (unpickling may import a framework: Lightning, transformers, accelerate)
        if cfg.get("authkey"):  # a Manager's proxies among the arguments connect with it
            multiprocessing.current_process().authkey = bytes.fromhex(cfg["authkey"])
        where.phase = Phase.UNPICKLE
        call = loading.load(payload, cfg.get("data"))  # the tensors and arrays are mapped, not copied
        # Sources of notebook cells, so tracebacks in the worker show the lines of cell code.
        linecache.cache.update(call.get("sources", {}))
        fn, args, kwargs = call["fn"], call["args"], call["kwargs"]
        if cfg.get("mode") == "session":  # a session's rank: its loop, not a function of the call
            from .session_loop import serve_session

            fn = serve_session

        where.phase = Phase.INIT
        kind, index = cfg["device"].split(":")
        device = torch.device("cuda", int(index)) if kind == "cuda" else torch.device("cpu")
        if kind == "cuda":
            torch.cuda.set_device(int(index))
        if meeting is not None:
            meeting.arrive("arrived", rank, world_size, cfg.get("timeout"))
            if arrived is not None:
                arrived(meeting)
        join_notebook_store(meeting)  # an env:// rendezvous meets at the notebook's store, every rank a client
        spawn_mode = cfg.get("mode") == "spawn"  # fn(rank, ...) sets up its own process group
        if not spawn_mode:
            where_to_meet: dict[str, Any] = ({"store": meeting.group_store()} if meeting is not None
                                             else {"init_method": "file://" + directory.rendezvous_path})
            dist.init_process_group(
                backend=cfg["backend"], rank=rank, world_size=world_size,
                timeout=datetime.timedelta(seconds=cfg["timeout"]), device_id=device if kind == "cuda" else None,
                **where_to_meet,
            )
            teardown.keep(dist.group.WORLD)
            if cfg["backend"] == "gloo":
                # gloo connects every pair inside init_process_group, and a rank may return from
                # it before its peers have: one that then fails at once closes its sockets under a
                # peer still connecting, which reports a knock-on set-up error instead of its own
                # (an error every rank raises would not be seen as the same on every rank).
                dist.barrier()

        ctx = WorkerContext(
            rank=rank, world_size=world_size, local_rank=cfg.get("local_rank", rank),
            local_world_size=cfg.get("local_world_size", world_size), device=device, device_name=cfg["device"],
            backend=cfg["backend"], run_id=cfg["run_id"], run_dir=cfg["run_dir"], send=send, stop_event=stop,
            progress_interval=cfg.get("progress_interval", 0.1), resume_from=cfg.get("resume_from"),
        )
        ctx._resume_data = cfg.get("resume_data")
        ctx._checkpoints_to_notebook = bool(cfg.get("checkpoints_to_notebook"))
        ctx._judged = bool(cfg.get("judged"))
        context.set_current(ctx)
        send({"kind": EventKind.READY, **({"torch": torch.__version__} if rank == 0 else {})})
        where.phase = Phase.RUN
        result = fn(rank, *args, **kwargs) if spawn_mode else fn(ctx, *args, **kwargs)
        ctx.flush()
        where.phase = Phase.RESULT
        if rank != 0:
            return None
        try:
            return packing.pack(result) if cfg.get("share_result") else Packed(pickling.dumps(result))
        except Exception as exc:  # noqa: BLE001 - said in the user's terms: what the function returned
            raise _named_result_error(exc, fn, result) from None
    except BaseException:
        if ctx is not None:
            ctx.flush()  # the last progress before the failure, for the panel and the report
        raise


def _named_result_error(exc: Exception, fn: Any, result: Any) -> Exception:
    """``exc`` with a message that names the function and the type it returned (its traceback is
    the pickler's, which means nothing to users)."""
    name = getattr(fn, "__name__", "the function")
    try:
        return type(exc)(f"{name} returned {type(result).__qualname__}, which cannot be pickled ({exc})")
    except Exception:  # noqa: BLE001 - an exception type whose constructor takes other arguments
        return exc


def flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed or broken stream must not hide the outcome
            pass
