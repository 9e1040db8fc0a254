"""Training functions with injected faults, importable by the worker processes."""
from __future__ import annotations

import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist


def ddp_steps(ctx, steps: int = 5, fault: str | None = None, bad_rank: int = 1, at_step: int = 3):
    """A DDP-like loop (one all_reduce per step) that injects ``fault`` on ``bad_rank``."""
    t = torch.ones(2)
    for step in range(1, steps + 1):
        if fault and ctx.rank == bad_rank and step == at_step:
            inject(fault, step)
        dist.all_reduce(t)
        ctx.log(step=step, total=steps, loss=1.0 / step)
    return t.tolist()


def inject(fault: str, step: int) -> None:
    if fault == "raise":
        raise ValueError(f"boom at step {step}")
    if fault == "exit":
        os._exit(3)
    if fault == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault == "segfault":
        ctypes.string_at(0)
    if fault == "stall":
        time.sleep(3600)
    raise AssertionError(fault)


def _load_on(rank: int, action: str):
    if os.environ.get("RANK") == str(rank):
        if action == "exit":
            os._exit(5)
        raise ModuleNotFoundError("No module named 'only_on_the_notebook_machine'")
    return "loaded"


class LoadFault:
    """An argument that pickles fine and fails while a worker loads it (on one rank)."""

    def __init__(self, rank: int, action: str) -> None:
        self.rank, self.action = rank, action

    def __reduce__(self):
        return (_load_on, (self.rank, self.action))


def takes_arg(ctx, arg):
    return arg


def wait_for_stop(ctx, honour: bool = True):
    """Report progress until asked to stop; with honour=False, ignore the request."""
    step = 0
    while not (honour and ctx.should_stop):
        step += 1
        ctx.log(step=step)
        time.sleep(0.01)
    return f"stopped at step {step}" if ctx.is_main else None


def marks_its_start_then_waits(ctx, folder: str):
    """Leave a file for the rank in ``folder`` (the function ran), then wait to be stopped."""
    open(os.path.join(folder, f"rank{ctx.rank}"), "w").close()
    return wait_for_stop(ctx)


def prints_a_lone_surrogate(ctx):
    print("x\ud800", flush=True)
    return ctx.rank


def asks_for_input(ctx):
    return input("learning rate? ")


def ignore_term_then_allreduce(ctx, steps: int = 5):
    """Rank 0 survives SIGTERM so that its knock-on error is reported; rank 1 is SIGKILLed."""
    if ctx.rank == 0:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return ddp_steps(ctx, steps=steps, fault="sigkill", bad_rank=1, at_step=3)


def engine_is_clean() -> dict:
    """Run on an ipyparallel engine after a run: what a run must leave as it found it."""
    import signal as _signal

    from ddp_notebook import current_context

    return {
        "process_group": dist.is_initialized(),
        "rank_env": os.environ.get("RANK"),
        "sigint": _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler,
        "context": current_context() is not None,
        "torchs_init": dist.init_process_group is dist.distributed_c10d.init_process_group
        and dist.init_process_group.__module__ == "torch.distributed.distributed_c10d",
        "pid": os.getpid(),
    }


def allreduce_until_stopped(ctx):
    """A naive stop: each rank leaves at the first step it sees the flag, so one rank may leave
    while its peer is already waiting in the next all_reduce."""
    t = torch.ones(1)
    step = 0
    while not ctx.should_stop:
        step += 1
        dist.all_reduce(t)
        ctx.log(step=step)
        time.sleep(0.005 * (1 + ctx.rank))
    return step


def allreduce_until_stop_agreed(ctx):
    """All-reduces until a Stop, every rank leaving at the same step (``ctx.stop_agreed``): a
    stop ends it at once, never after the stop grace as a naive stop may."""
    t = torch.ones(1)
    step = 0
    while not ctx.stop_agreed():
        step += 1
        dist.all_reduce(t)
        ctx.log(step=step)
        time.sleep(0.005 * (1 + ctx.rank))
    return step


def one_more_allreduce_on_rank_1(ctx, steps: int = 3):
    """Rank 1 makes one more all_reduce than rank 0 (uneven batches): it waits for a peer that
    has already returned."""
    t = torch.ones(1)
    for step in range(1, steps + 1 + (ctx.rank == 1)):
        dist.all_reduce(t)
        ctx.log(step=step)
    return step


def hang_on_rank(ctx, bad_rank: int = 1, report_first: bool = False):
    """``bad_rank`` hangs (sleeping, so frozen) while its peers wait for it in an all_reduce;
    nobody calls ``ctx.log`` unless ``report_first``."""
    t = torch.ones(1)
    if report_first:
        ctx.log(step=1)
    if ctx.rank == bad_rank:
        time.sleep(3600)
    dist.all_reduce(t)
    return t.item()


def busy_outside_collective(ctx, seconds: float):
    """Rank 0 computes for ``seconds`` without reporting while rank 1 waits in an all_reduce:
    slow, not hung."""
    t = torch.ones(1)
    if ctx.rank == 0:
        end, x = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            x += 1
    dist.all_reduce(t)
    return t.item()


def quiet_without_collective(ctx, seconds: float):
    """Every rank sleeps without reporting and without waiting for a peer: quiet, not hung."""
    time.sleep(seconds)
    return ctx.rank


def same_error_everywhere(ctx, config: dict):
    """Every rank makes the same mistake: a key the configuration does not have."""
    ctx.log(step=1)
    return config["learning_rate"]


def deadlock(ctx):
    """Collectives that do not match: rank 0 waits at a barrier, rank 1 for a message from rank 0."""
    ctx.log(step=1)
    if ctx.rank == 0:
        dist.barrier()
    else:
        dist.recv(torch.zeros(1), src=0)
    return ctx.rank


def hang_after_quick_steps(ctx, steps: int = 5):
    """Rank 1 reports ``steps`` steps faster than the throttle sends them, then hangs."""
    for step in range(1, steps + 1):
        ctx.log(step=step)
    if ctx.rank == 1:
        time.sleep(3600)
    dist.barrier()
    return step


def busy_in_a_child_process(ctx, seconds: float):
    """Rank 0's work runs in a subprocess (a preprocessing script) while rank 1 waits at a
    barrier: busy, not hung."""
    import subprocess
    import sys

    if ctx.rank == 0:
        subprocess.run([sys.executable, "-c", f"import time\nend = time.monotonic() + {seconds}\n"
                        "while time.monotonic() < end: pass"], check=True)
    dist.barrier()
    return ctx.rank


def own_sigusr1_handler_while_busy(ctx, seconds: float):
    """User code that handles SIGUSR1 (a cluster's requeue handler) and works while rank 1 waits:
    the watchdog's stack requests must never trigger it."""
    def requeue(*_):
        raise SystemExit("requeue asked")

    signal.signal(signal.SIGUSR1, requeue)
    if ctx.rank == 0:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
    dist.barrier()
    return ctx.rank


def wait_for_stop_carrying(ctx, ballast: bytes):
    """``wait_for_stop`` with a large argument."""
    return wait_for_stop(ctx) if ballast else None


def returns_a_class_only_the_workers_have(ctx, folder: str):
    """Rank 0 returns an object whose class lives in a module the notebook cannot import."""
    import importlib
    import sys

    with open(os.path.join(folder, f"only_in_workers_{ctx.rank}.py"), "w") as f:
        f.write("class Thing:\n    pass\n")
    sys.path.insert(0, folder)
    return importlib.import_module(f"only_in_workers_{ctx.rank}").Thing()


def environment(ctx, names: tuple):
    """What a worker sees of the notebook: these environment variables and its working directory."""
    return {name: os.environ.get(name) for name in names}, os.getcwd()


def prints_and_logs(ctx, mb: int, metric_chars: int):
    """Prints ``mb`` MB of numbered 64-byte lines, logs a huge string metric, then raises an
    error whose message is huge too."""
    import sys

    for i in range(mb * 2**20 // 64):
        sys.stdout.write(f"line {i} ".ljust(63, ".") + "\n")
        if i % 10_000 == 0:
            ctx.log(step=i, blob="b" * metric_chars)
    sys.stdout.flush()
    raise ValueError("big " + "q" * 10**6 + " end")


def prints_text(ctx, text: str, times: int):
    """Prints ``text`` ``times`` times, with no newline in between."""
    import sys

    for _ in range(times):
        sys.stdout.write(text)
    sys.stdout.write("\n")
    sys.stdout.flush()


def data_steps(ctx, data, **kwargs):
    """``ddp_steps`` after reading every page of ``data`` (a tensor the call shares)."""
    assert float(data.sum()) == data.numel()
    return ddp_steps(ctx, **kwargs)


def hold_data(ctx, data):
    """Read ``data`` (a tensor the call shares), say so, and stay until ended."""
    float(data.sum())
    ctx.log(step=1)
    time.sleep(3600)


class UnprintableError(Exception):
    def __str__(self):
        raise RuntimeError("the exception's own __str__ fails")


def raises_unprintable(ctx, bad_rank=1):
    """Raises an exception whose str() raises too, on ``bad_rank``; its peer waits in a collective."""
    if ctx.rank == bad_rank:
        raise UnprintableError()
    dist.barrier()


def logs_odd_names(ctx):
    """Metrics named like ctx.log's own parameters and a value that is no real number."""
    ctx.log(step=1, total=1, self=1.0, loss=2.0)
    try:
        ctx.log(step=1, cplx=1 + 2j)
    except TypeError as e:
        return str(e)


def returns_early(ctx, at_step=5):
    """Rank 1 returns at ``at_step``; rank 0 goes on calling all_reduce (it waits for rank 1 forever)."""
    for step in range(1, 10_000):
        if ctx.rank == 1 and step == at_step:
            return "left early"
        dist.all_reduce(torch.ones(1))
        ctx.log(step=step)
        time.sleep(0.01)


def bar_then_exit(ctx):
    """Rank 1 draws a progress bar on stderr (redrawn with carriage returns), then exits."""
    import sys

    if ctx.rank == 1:
        sys.stderr.write("\x1b[33mload\x1b[0m 10%\rload 50%\rload 90%\n")
        sys.stderr.flush()
        os._exit(3)
    dist.barrier()


def holds_the_gil_on_rank_1(ctx, seconds: float):
    """Rank 1 sleeps in C holding the GIL (as a long C call does) while rank 0 waits in an all_reduce."""
    t = torch.ones(1)
    dist.all_reduce(t)
    if ctx.rank == 1:
        ctypes.PyDLL(None).sleep(int(seconds))  # PyDLL keeps the GIL for the call: no Python thread runs
    dist.all_reduce(t)
    return t.item()


def means_unless_two(ctx, net):
    """Fails on a run of two ranks (rank 1 raises); on one rank, the means of the model's weight and bias."""
    if ctx.world_size == 2 and ctx.rank == 1:
        raise ValueError("the first try fails")
    return float(net.weight.mean()), float(net.bias.mean())


def fails_when_two(ctx, *args):
    """Rank 1 of a run of two raises; a run of one returns its arguments."""
    if ctx.world_size == 2 and ctx.rank == 1:
        raise ValueError("the first try fails")
    return args


def sum_when_told(ctx, data, flag: str):
    """Waits until the file ``flag`` exists (the notebook changed something meanwhile), then sums ``data``."""
    import numpy as np

    ctx.log(step=0)
    while not os.path.exists(flag):
        time.sleep(0.02)
    return float(np.asarray(data).sum())


def returns_the_context(ctx):
    """The mistake of returning what cannot be pickled (the ctx holds locks and a pipe)."""
    return ctx


def saves_a_checkpoint(ctx):
    """Save one checkpoint (the latest and the best) and return the rank."""
    import torch

    ctx.save_checkpoint({"w": torch.zeros(2)}, epoch=0, best=True)
    return ctx.rank


def fails_until_resumed(ctx, times: int = 1):
    """Save a checkpoint counting the attempts, and raise on rank 1 until ``times`` attempts failed;
    then return the attempts made (each restart resumes from the last checkpoint)."""
    state = ctx.load_checkpoint() or {"attempt": 0}
    attempt = state["attempt"] + 1
    ctx.save_checkpoint({"attempt": attempt}, epoch=attempt)
    import torch.distributed as dist

    dist.barrier()  # the checkpoint is saved before rank 1 raises
    if attempt <= times and ctx.rank == 1:
        raise ValueError(f"attempt {attempt} fails")
    return attempt


def leaves_subprocesses(ctx, folder: str, then: str):
    """Start a subprocess that starts one of its own (both in the rank's process group), note
    their pids in ``folder``, then: return, raise on rank 1, be SIGKILLed on rank 1, or wait for
    a stop."""
    import subprocess

    shell = subprocess.Popen(["sh", "-c", "sleep 1000 & echo $!; wait"], stdout=subprocess.PIPE, text=True)
    grandchild = int(shell.stdout.readline())
    with open(os.path.join(folder, f"rank{ctx.rank}"), "w") as f:
        f.write(f"{shell.pid} {grandchild}")
    if then == "raise" and ctx.rank == 1:
        raise ValueError("left its subprocesses")
    if then == "sigkill" and ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if then == "wait":
        return wait_for_stop(ctx)
    return ctx.rank


def front_ends_loaded_then_the_api(ctx):
    """Whether the package's front ends were imported before the rank asked the package for a
    name, then a name of its API, and whether the front ends were imported by that."""
    import sys

    before = sorted(m for m in ("ipywidgets", "ddp_notebook.ui.panel", "ddp_notebook.lifecycle.launch")
                    if m in sys.modules)
    import ddp_notebook
    from ddp_notebook import WorkerFailedError

    return (before, WorkerFailedError.__name__, ddp_notebook.errors.CellError.__name__,
            "ddp_notebook.lifecycle.launch" in sys.modules)
