"""First launch → every rank past step 1, for ddp_notebook and torch.multiprocessing.

Each trial runs in a fresh Python process (a notebook's first launch), trials of the
launchers are interleaved, and medians are printed as a markdown table:

    .venv/bin/python benchmarks/launch_bench.py            # 5 trials each
    .venv/bin/python benchmarks/launch_bench.py --quick    # 1 trial each (CI smoke test)

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

LAUNCHERS = ("ddp_notebook", "mp-fork", "mp-spawn")


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


def trial(launcher: str) -> dict:
    import threading

    import ddp_notebook  # imported before timing, like torch.multiprocessing (a notebook's %load_ext)
    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    if launcher == "ddp_notebook":
        seen = threading.Event()
        run = ddp_notebook.launch(_ours_rank, devices="cpu*2")
        run.subscribe(lambda e: seen.set() if all((w.step or 0) >= 1 for w in run.state.workers.values()) else None)
        if not all((w.step or 0) >= 1 for w in run.state.workers.values()):
            seen.wait(120)
        first = time.perf_counter() - t0
        run.wait(120)
    else:
        method = launcher.split("-")[1]
        ctx = mp.get_context(method)
        queue = ctx.SimpleQueue()
        init_file = os.path.join(tempfile.mkdtemp(), "rdv")
        procs = mp.start_processes(_mp_rank, args=(queue, init_file), nprocs=2, join=False, start_method=method)
        queue.get(), queue.get()
        first = time.perf_counter() - t0
        procs.join()
    return {"first_step": first, "done": time.perf_counter() - t0}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--trial", choices=LAUNCHERS)
    args = parser.parse_args()
    if args.trial:
        import torch  # noqa: F401 - a notebook has torch imported before it launches

        print(json.dumps(trial(args.trial)))
        return
    trials = 1 if args.quick else args.trials
    results: dict[str, list[dict]] = {k: [] for k in LAUNCHERS}
    env = dict(os.environ, DDP_NOTEBOOK_RUNS=tempfile.mkdtemp())
    for _ in range(trials):
        for launcher in LAUNCHERS:
            out = subprocess.run([sys.executable, __file__, "--trial", launcher], capture_output=True, text=True,
                                 env=env, timeout=300)
            if out.returncode != 0:
                raise SystemExit(f"{launcher} failed:\n{out.stderr}")
            results[launcher].append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"First launch, 2 gloo ranks on CPU, median of {trials} fresh processes")
    print()
    print("| launcher | CUDA-safe | cell-defined fn | launch → all ranks past step 1 | launch → all exited |")
    print("|---|---|---|---|---|")
    notes = {"ddp_notebook": ("yes", "yes"), "mp-fork": ("no", "yes"), "mp-spawn": ("yes", "no")}
    for launcher in LAUNCHERS:
        first = statistics.median(r["first_step"] for r in results[launcher])
        done = statistics.median(r["done"] for r in results[launcher])
        safe, cell = notes[launcher]
        print(f"| {launcher} | {safe} | {cell} | {first:.2f} s | {done:.2f} s |")


if __name__ == "__main__":
    main()
