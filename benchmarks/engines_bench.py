"""Runs on ipyparallel engines beside local workers and torch.multiprocessing, in one process.

A notebook that already holds a cluster relaunches onto warm engines; the local anchors are
a relaunch with ddp_notebook's fork server and torch.multiprocessing fork/spawn. Each trial:
launch → every rank past step 1 (one all_reduce), → the run has ended; and a raise on rank 1
→ the error in the notebook. Trials are interleaved; medians are printed as a markdown table:

    .venv/bin/python benchmarks/engines_bench.py           # 5 trials each
    .venv/bin/python benchmarks/engines_bench.py --quick   # 1 trial each (CI smoke test)
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import scratch  # (benchmarks/scratch.py)
from launch_bench import _mp_once


def _step(ctx, fail: bool = False):
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.ones(1))
    ctx.log(step=1)
    if fail and ctx.rank == 1:
        raise ValueError("injected")
    dist.barrier()


def _ours(engines=None, fail: bool = False) -> tuple[float, float]:
    import ddp_notebook

    t0 = time.perf_counter()
    seen = threading.Event()
    run = ddp_notebook.launch(_step, engines=engines, kwargs={"fail": fail},
                              devices=None if engines is not None else "cpu*2")
    run.subscribe(lambda e: seen.set() if all((w.step or 0) >= 1 for w in run.state.workers.values()) else None)
    if not fail and not all((w.step or 0) >= 1 for w in run.state.workers.values()):
        seen.wait(120)
    first = time.perf_counter() - t0
    try:
        run.wait(120)
    except ddp_notebook.WorkerFailedError:
        pass
    return first, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="one trial each")
    parser.add_argument("--smoke", action="store_true", help="--quick without the rows that only add fresh "
                        "interpreters (torch.multiprocessing spawn): the CI "
                        "smoke test")
    args = parser.parse_args()
    trials = 1 if args.quick or args.smoke else args.trials

    import ipyparallel as ipp


    # (smoke: the controller pings every 0.5 s, not 3 s, so the engines' registration ends 4 s
    # sooner; 66 missed pings, not 10, before one is dropped: 33 s as by default. Nothing timed
    # here starts a cluster.)
    smoke_args = ["--HeartMonitor.period=500", "--HeartMonitor.max_heartmonitor_misses=66"] if args.smoke else []
    if args.smoke:  # (and the fork server imports torch meanwhile, not after)
        from ddp_notebook.executors.local import forkserver

        forkserver.start()
    cluster = ipp.Cluster(n=2, log_level=40, controller_args=smoke_args)
    rc = cluster.start_and_connect_sync(activate=False)
    try:
        _ours(rc), _ours()  # first contact: engines import torch, the fork server starts
        rows: dict[str, list] = {"ipyparallel engines (warm), ddp_notebook": [],
                                 "local workers, ddp_notebook fork server": [],
                                 "torch.multiprocessing fork": [], "torch.multiprocessing spawn": []}
        errors: dict[str, list] = {"ipyparallel engines (warm), ddp_notebook": [],
                                   "local workers, ddp_notebook fork server": []}
        for _ in range(trials):
            rows["ipyparallel engines (warm), ddp_notebook"].append(_ours(rc))
            errors["ipyparallel engines (warm), ddp_notebook"].append(_ours(rc, fail=True)[1])
            rows["local workers, ddp_notebook fork server"].append(_ours())
            errors["local workers, ddp_notebook fork server"].append(_ours(fail=True)[1])
            rows["torch.multiprocessing fork"].append(_mp_once("fork"))
            if not args.smoke:
                rows["torch.multiprocessing spawn"].append(_mp_once("spawn"))
    finally:
        rc.close()
        cluster.stop_cluster_sync()

    print(f"Relaunch on 2 ranks, median of {trials} (seconds)\n")
    print("| launcher | → every rank past step 1 | → run ended | rank 1 raises after step 1: → error in the notebook |")
    print("|---|---|---|---|")
    for name, values in rows.items():
        if not values:
            continue
        first = statistics.median(v[0] for v in values)
        ended = statistics.median(v[1] for v in values)
        err = f"{statistics.median(errors[name]):.3f}" if name in errors else "n/a"
        print(f"| {name} | {first:.3f} | {ended:.3f} | {err} |")


if __name__ == "__main__":
    scratch.use()
    main()
