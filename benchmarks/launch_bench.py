"""First launch → every rank past step 1, for ddp_notebook and torch.multiprocessing.

Each trial runs in a fresh Python process (a notebook's first launch), trials of the
launchers are interleaved, and medians are printed as a markdown table:

    .venv/bin/python benchmarks/launch_bench.py            # 5 trials each
    .venv/bin/python benchmarks/launch_bench.py --quick    # 1 trial each

Every launcher runs the same rank body: gloo process group from a file rendezvous, one
all_reduce (step 1), report to the parent.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import scratch  # (benchmarks/scratch.py)

LAUNCHERS = ("ddp_notebook", "ddp_notebook-fresh", "mp-fork", "mp-spawn")


def _mp_rank(rank, queue, init_file):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    dist.all_reduce(torch.ones(1))
    queue.put(rank)
    dist.barrier()


def _ours_rank(ctx):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    ctx.log(step=1)
    dist.barrier()


def _ours_once(fn=None) -> tuple[float, float]:
    import threading

    import ddp_notebook

    t0 = time.perf_counter()
    seen = threading.Event()
    run = ddp_notebook.launch(fn or _ours_rank, devices="cpu*2")
    run.subscribe(lambda e: seen.set() if all((w.step or 0) >= 1 for w in run.state.workers.values()) else None)
    if not all((w.step or 0) >= 1 for w in run.state.workers.values()):
        seen.wait(120)
    first = time.perf_counter() - t0
    run.wait(120)
    return first, time.perf_counter() - t0


def _mp_once(method: str) -> tuple[float, float]:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    t0 = time.perf_counter()
    ctx = mp.get_context(method)
    queue = ctx.SimpleQueue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdv")
    procs = mp.start_processes(_mp_rank, args=(queue, init_file), nprocs=2, join=False, start_method=method)
    queue.get(), queue.get()
    first = time.perf_counter() - t0
    try:
        procs.join()
    except ProcessException as e:  # a clean run that died at exit (seen: SIGABRT in gloo teardown)
        MISREPORTED.append(f"{method}: {e}")
    return first, time.perf_counter() - t0


FAULTS = ("raise", "exit", "sigkill")
MISREPORTED: list[str] = []  # clean anchor runs reported as failed (counted, not fatal)


def _fault_at_10(rank: int, fault: str, stamp: str) -> None:
    import signal

    with open(stamp, "w") as f:  # when the fault happened, for the parent to compare
        f.write(repr(time.time()))
    if fault == "raise":
        raise ValueError("boom at step 10")
    if fault == "exit":
        os._exit(3)
    os.kill(os.getpid(), signal.SIGKILL)


def _ours_fault(ctx, fault, stamp):
    import torch
    import torch.distributed as dist

    for step in range(1, 100):
        if ctx.rank == 1 and step == 10:
            _fault_at_10(ctx.rank, fault, stamp)
        dist.all_reduce(torch.ones(1))
        ctx.log(step=step)


def _mp_fault(rank, init_file, fault, stamp):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    for step in range(1, 100):
        if rank == 1 and step == 10:
            _fault_at_10(rank, fault, stamp)
        dist.all_reduce(torch.ones(1))


def failure_latency(launcher: str, fault: str) -> dict:
    """Rank 1 fails at step 10: seconds until the parent has the error, and until all are reaped."""
    stamp = os.path.join(tempfile.mkdtemp(), "stamp")
    if launcher.startswith("ddp_notebook"):
        import ddp_notebook

        run = ddp_notebook.launch(_ours_fault, devices="cpu*2", args=(fault, stamp))
        known = []
        run.subscribe(lambda e: known.append(time.time()) if e["kind"] == "failure" and not known else None)
        try:
            run.wait(120)
        except ddp_notebook.WorkerFailedError:
            pass
        reaped = run.state.ended_at
    else:
        import torch.multiprocessing as mp
        from torch.multiprocessing.spawn import ProcessException

        procs = mp.start_processes(_mp_fault, args=(os.path.join(tempfile.mkdtemp(), "rdv"), fault, stamp),
                                   nprocs=2, join=False, start_method=launcher.split("-")[1])
        known = []
        try:
            while not procs.join():
                pass
        except ProcessException:
            known.append(time.time())
        for p in procs.processes:  # join() raised after terminating the peers; wait until they are gone
            p.join()
        reaped = time.time()
    with open(stamp) as f:
        failed_at = float(f.read())
    return {"error": known[0] - failed_at, "reaped": reaped - failed_at}


def trial(launcher: str) -> dict:
    import torch.multiprocessing  # noqa: F401

    import ddp_notebook  # noqa: F401 - imported before timing, like torch.multiprocessing (a notebook's %load_ext)

    if launcher == "ddp_notebook-fresh":
        from ddp_notebook.executors.local import forkserver

        forkserver.disable()  # every worker a fresh interpreter (no fork server: off Linux, or switched off)
    once = _ours_once if launcher.startswith("ddp_notebook") else (lambda: _mp_once(launcher.split("-")[1]))
    first, done = once()
    again, _ = once()  # relaunch in the same process
    out = {"first_step": first, "done": done, "relaunch": again, "misreported": len(MISREPORTED)}
    for fault in FAULTS:
        out.update({f"{fault}_{k}": v for k, v in failure_latency(launcher, fault).items()})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="--quick without the rows that only add fresh "
                        "interpreters (torch.multiprocessing spawn, ddp_notebook without a fork server): the CI "
                        "smoke test")
    parser.add_argument("--trial", choices=LAUNCHERS)
    args = parser.parse_args()
    if args.trial:
        import torch  # noqa: F401 - a notebook has torch imported before it launches

        print(json.dumps(trial(args.trial)))
        return
    trials = 1 if args.quick or args.smoke else args.trials
    launchers = ("ddp_notebook", "mp-fork") if args.smoke else LAUNCHERS
    results: dict[str, list[dict]] = {k: [] for k in launchers}
    env = dict(os.environ, DDP_NOTEBOOK_RUNS=tempfile.mkdtemp())
    for _ in range(trials):
        for launcher in launchers:
            out = subprocess.run([sys.executable, __file__, "--trial", launcher], capture_output=True, text=True,
                                 env=env, timeout=300)
            if out.returncode != 0:
                raise SystemExit(f"{launcher} failed:\n{out.stderr}")
            results[launcher].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"2 gloo ranks on CPU, median of {trials} fresh processes per launcher")
    print()
    print("| launcher | CUDA-safe | cell-defined fn | first launch → all ranks past step 1 | relaunch in the same "
          "process | rank 1 raises / exits / is SIGKILLed → parent has the error | → all peers reaped |")
    print("|---|---|---|---|---|---|---|")
    notes = {"ddp_notebook": ("yes", "yes"), "ddp_notebook-fresh": ("yes", "yes"), "mp-fork": ("no", "yes"),
             "mp-spawn": ("yes", "no")}
    names = {"ddp_notebook": "ddp_notebook, fork server started by the launch",
             "ddp_notebook-fresh": "ddp_notebook, fresh interpreters (fork server off)",
             "mp-fork": "torch.multiprocessing fork", "mp-spawn": "torch.multiprocessing spawn"}
    for launcher in launchers:
        med = {k: statistics.median(r[k] for r in results[launcher]) for k in results[launcher][0]}
        safe, cell = notes[launcher]
        errors = " / ".join(f"{med[f + '_error']:.3f}" for f in FAULTS)
        reaped = " / ".join(f"{med[f + '_reaped']:.3f}" for f in FAULTS)
        print(f"| {names[launcher]} | {safe} | {cell} | {med['first_step']:.3f} s | {med['relaunch']:.3f} s | "
              f"{errors} s | {reaped} s |")
    lost = {name: sum(r["misreported"] for r in results[name]) for name in launchers}
    if any(lost.values()):
        print()
        print("Clean launches reported as failed (exit-time crash): "
              + ", ".join(f"{names[k]}: {v}" for k, v in lost.items() if v))


if __name__ == "__main__":
    scratch.use()
    main()
