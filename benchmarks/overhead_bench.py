"""Monitoring overhead: steps/s of one 2-rank DDP loop with per-step progress reported to a
live run state (ctx.log every step, a subscriber folding every event) vs with no reporting.

    .venv/bin/python benchmarks/overhead_bench.py [--quick]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import scratch  # (benchmarks/scratch.py)


def loop(ctx, steps: int, report: bool) -> float:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randn(64, 1)
    for step in range(steps + 20):
        if step == 20:
            t0 = time.perf_counter()
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if report:
            ctx.log(step=step + 1, total=steps + 20, loss=loss.item())
    return steps / (time.perf_counter() - t0)


def measure(steps: int, report: bool) -> float:
    import ddp_notebook

    run = ddp_notebook.launch(loop, devices="cpu*2", args=(steps, report))
    seen = []
    run.subscribe(seen.append)  # a live consumer of every event, as the panel is
    return run.wait(120)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", "--smoke", action="store_true")  # --smoke: the CI smoke test
    args = parser.parse_args()
    trials, steps = (1, 100) if args.quick else (args.trials, args.steps)
    os.environ.setdefault("DDP_NOTEBOOK_RUNS", tempfile.mkdtemp())

    from ddp_notebook.executors.local import forkserver

    forkserver.start()  # what %load_ext does
    while not forkserver.status()["ready"]:
        time.sleep(0.05)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for trial in range(trials):
        for report in ((False, True) if trial % 2 == 0 else (True, False)):  # alternate: no order bias
            rates[report].append(measure(steps, report))
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print("trials (steps/s): none", [round(r) for r in rates[False]], "reporting", [round(r) for r in rates[True]])
    print(f"Monitoring overhead, 2 gloo ranks, small MLP, {steps} timed steps, median of {trials}")
    print()
    print("| reporting | steps/s | ratio |")
    print("|---|---|---|")
    print(f"| none | {off:,.0f} | 1.000 |")
    print(f"| ctx.log every step (throttled to 10/s per rank), live state | {on:,.0f} | {on / off:.3f} |")
    print()
    print(f"ctx.log itself costs {log_cost_us():.1f} µs a call (in-process, {1e6 / off:.0f} µs a step here).")


def log_cost_us(n: int = 20000) -> float:
    """The cost of one ctx.log call, measured directly (what the reporting adds to a step)."""
    import threading

    import torch

    from ddp_notebook.worker.context import WorkerContext

    ctx = WorkerContext(rank=0, world_size=2, device=torch.device("cpu"), device_name="cpu:0", backend="gloo",
                        run_id="bench", run_dir=tempfile.gettempdir(), send=lambda event: None,
                        stop_event=threading.Event())
    loss = torch.tensor(0.5)
    t0 = time.perf_counter()
    for i in range(n):
        ctx.log(step=i + 1, total=n, loss=loss.item())
    return (time.perf_counter() - t0) / n * 1e6


if __name__ == "__main__":
    scratch.use()
    main()
