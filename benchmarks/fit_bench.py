"""Throughput of a small MLP fit on 2 CPU ranks: thread settings, and us vs torch.multiprocessing spawn.

    .venv/bin/python benchmarks/fit_bench.py            # 3 trials each
    .venv/bin/python benchmarks/fit_bench.py --quick    # 1 trial, fewer steps (CI smoke test)

Rows, interleaved, medians of samples/s over the timed steps (start-up excluded):
- ddp_notebook, threads = cores // ranks (the default);
- ddp_notebook, threads = cores (torch's own default: every rank uses every core);
- torch.multiprocessing spawn running the same loop with torch's default threads.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import scratch  # (benchmarks/scratch.py)
import torch


def loop(rank: int, world: int, steps: int, queue=None, init_file: str | None = None, threads: int | None = None):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    if init_file is not None:  # the torch.multiprocessing variant sets up its own group
        if threads:
            torch.set_num_threads(threads)
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=world)
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                                    torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(128, 256), torch.randint(0, 10, (128,))
    for step in range(steps + 5):
        if step == 5:  # warm-up done
            dist.barrier()
            t0 = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    rate = steps * 128 * world / (time.perf_counter() - t0)
    if queue is not None and rank == 0:
        queue.put(rate)
    return rate


def ours(ctx, steps):
    return loop(ctx.rank, ctx.world_size, steps)


def run_ours(steps: int, threads: int | None) -> float:
    import ddp_notebook

    return ddp_notebook.launch(ours, devices="cpu*2", args=(steps,), threads_per_worker=threads).wait()


def run_spawn(steps: int, threads: int | None = None) -> float:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    init_file = os.path.join(tempfile.mkdtemp(), "rdv")
    from torch.multiprocessing.spawn import ProcessException

    procs = mp.start_processes(_spawn_entry, args=(2, steps, queue, init_file, threads), nprocs=2, join=False,
                               start_method="spawn")
    rate = queue.get()  # rank 0 has timed its steps; what follows is teardown
    try:
        procs.join()
    except ProcessException as e:  # a clean run that died at exit (seen: SIGABRT in gloo teardown)
        ABORTED_AT_EXIT.append(str(e))
    return rate


ABORTED_AT_EXIT: list[str] = []  # spawn runs that timed their steps, then died at exit (counted, not fatal)


def _spawn_entry(rank, world, steps, queue, init_file, threads):
    loop(rank, world, steps, queue, init_file, threads)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--quick", "--smoke", action="store_true")  # --smoke: the CI smoke test
    args = parser.parse_args()
    trials, steps = (1, 20) if args.quick else (args.trials, args.steps)
    os.environ.setdefault("DDP_NOTEBOOK_RUNS", tempfile.mkdtemp())
    from ddp_notebook.core.probes import cpu_count

    cores = cpu_count()
    rows = {
        f"ddp_notebook, {max(1, cores // 2)} thread(s) per rank (default)": lambda: run_ours(steps, None),
        f"ddp_notebook, {cores} threads per rank (torch default)": lambda: run_ours(steps, cores),
        "torch.multiprocessing spawn, torch default threads": lambda: run_spawn(steps),
    }
    results: dict[str, list[float]] = {k: [] for k in rows}
    for _ in range(trials):
        for name, fn in rows.items():
            results[name].append(fn())
    base = statistics.median(results["torch.multiprocessing spawn, torch default threads"])
    print(f"MLP fit (256-512-512-10, batch 128 per rank), 2 gloo ranks on {cores} cores, "
          f"{steps} timed steps, median of {trials}")
    print()
    print("| setup | samples/s | vs spawn |")
    print("|---|---|---|")
    for name, values in results.items():
        m = statistics.median(values)
        print(f"| {name} | {m:,.0f} | {m / base:.2f}x |")
    if ABORTED_AT_EXIT:
        print()
        print(f"({len(ABORTED_AT_EXIT)} spawn run(s) died at exit after timing their steps: "
              f"{ABORTED_AT_EXIT[0]})")


if __name__ == "__main__":
    scratch.use()
    main()
