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
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    trials, steps = (1, 100) if args.quick else (args.trials, args.steps)
    os.environ.setdefault("DDP_NOTEBOOK_RUNS", tempfile.mkdtemp())
    import ddp_notebook

    ddp_notebook.pool.enable(2)
    rates: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(trials):
        for report in (False, True):
            ddp_notebook.pool.get_pool().wait_warm()
            rates[report].append(measure(steps, report))
    ddp_notebook.pool.disable()
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print(f"Monitoring overhead, 2 gloo ranks, small MLP, {steps} timed steps, median of {trials}")
    print()
    print("| reporting | steps/s | ratio |")
    print("|---|---|---|")
    print(f"| none | {off:,.0f} | 1.000 |")
    print(f"| ctx.log every step (throttled to 10/s per rank), live state | {on:,.0f} | {on / off:.3f} |")


if __name__ == "__main__":
    main()
