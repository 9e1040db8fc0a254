"""Experiments: what trackers cost a training loop, and how long a comparison of many runs takes
to show.

1. Steps/s of one 2-rank DDP loop that logs every step (``ctx.log``), with TensorBoard and
   MLflow attached (``report_to=["tensorboard", "mlflow"]``: every value of rank 0 to both, from
   the notebook) against the same loop without trackers, trials alternated in one run.
2. ``compare()`` of N runs of M logged steps each, read from their logs on disk and rendered as
   the notebook shows it (curves and table, HTML with the PNG inside): the first one in a fresh
   process (matplotlib imported by it) and again.

    .venv/bin/python benchmarks/experiments_bench.py [--quick | --smoke]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

import scratch  # (benchmarks/scratch.py)
from overhead_bench import loop  # the same loop: its ctx.log(step=, total=, loss=) every step


def mlflow_store() -> None:
    """MLflow's store for the tracked runs: a fresh SQLite database (seconds: MLflow's import, its tables)."""
    import mlflow

    mlflow.set_tracking_uri(f"sqlite:///{tempfile.mkdtemp()}/mlflow.db")
    mlflow.set_experiment("ddp_notebook benchmark")


def tracker_overhead(trials: int, steps: int) -> None:
    import mlflow

    import ddp_notebook

    rates: dict[bool, list[float]] = {True: [], False: []}
    walls: dict[bool, list[float]] = {True: [], False: []}
    sent: list[int] = []
    for trial in range(trials):
        for tracked in ((False, True) if trial % 2 == 0 else (True, False)):  # alternate: no order bias
            t = time.perf_counter()
            run = ddp_notebook.launch(loop, devices="cpu*2", args=(steps, True),
                                      report_to=["tensorboard", "mlflow"] if tracked else None)
            rates[tracked].append(run.wait(300))
            walls[tracked].append(time.perf_counter() - t)
            if tracked:
                notes = run.state.tracker_notes
                assert not notes, notes
                history = mlflow.MlflowClient().get_metric_history(_mlflow_run(run.id), "loss")
                sent.append(len(history))
    off, on = statistics.median(rates[False]), statistics.median(rates[True])
    print("trials (steps/s): none", [round(r) for r in rates[False]], "tensorboard+mlflow",
          [round(r) for r in rates[True]])
    print(f"Trackers, 2 gloo ranks, small MLP, ctx.log every step, {steps} timed steps, median of {trials}")
    print()
    print("| trackers | steps/s | ratio | launch to wait() returning | values in MLflow |")
    print("|---|---|---|---|---|")
    print(f"| none | {off:,.0f} | 1.000 | {statistics.median(walls[False]):.2f} s | |")
    print(f"| TensorBoard and MLflow (report_to) | {on:,.0f} | {on / off:.3f} | {statistics.median(walls[True]):.2f} s "
          f"| {min(sent)} of {steps + 20} |")
    print()


def _mlflow_run(run_id: str) -> str:
    import mlflow

    found = mlflow.search_runs(filter_string=f"tags.`ddp_notebook.run_id` = '{run_id}'", output_format="list",
                               search_all_experiments=True)
    return str(found[0].info.run_id)


def logs(ctx, lr: float, steps: int) -> None:
    for epoch in ctx.epochs(10):
        for i in range(steps // 10):
            step = epoch * (steps // 10) + i + 1
            ctx.log(step=step, total=steps, loss=lr / step ** 0.5)
        ctx.log(valid_loss=lr / (epoch + 1), acc=1 - lr / (epoch + 2))


SHOW = """
import os, sys, time
import ddp_notebook
times = []
for _ in range({repeat}):
    t = time.perf_counter()
    html = ddp_notebook.compare(last={runs}).html()
    times.append(time.perf_counter() - t)
print(" ".join(f"{{x:.3f}}" for x in times), len(html))
"""


def comparison(runs: int, steps: int, repeat: int) -> None:
    import ddp_notebook

    t = time.perf_counter()
    for i in range(runs):
        ddp_notebook.launch(logs, devices="cpu*2", args=(0.001 * (i + 1), steps), name=f"run {i}").wait(300)
    made = time.perf_counter() - t
    # A fresh process, as a notebook after a restart: the runs are read from their logs.
    done = subprocess.run([sys.executable, "-c", SHOW.format(runs=runs, repeat=repeat)], capture_output=True,
                          text=True, check=True, cwd=os.getcwd())
    times = [float(x) for x in done.stdout.split()[:-1]]
    print(f"compare() of {runs} runs x {steps} logged steps (2 ranks each; {made:.0f} s to make them), read from "
          "disk and rendered as HTML with the curves' PNG")
    print()
    print("| comparison | first, in a fresh process | again |")
    print("|---|---|---|")
    again = f"{statistics.median(times[1:]):.2f} s" if len(times) > 1 else ""
    print(f"| ddp_notebook.compare(last={runs}) | {times[0]:.2f} s | {again} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--quick", "--smoke", action="store_true")  # --smoke: the CI smoke test
    args = parser.parse_args()
    trials, steps, runs, logged = (1, 100, 5, 100) if args.quick else (args.trials, args.steps, args.runs, 1000)
    os.environ.setdefault("DDP_NOTEBOOK_RUNS", tempfile.mkdtemp())
    os.chdir(tempfile.mkdtemp())  # the comparison holds the runs launched from here

    from ddp_notebook.executors.local import forkserver

    forkserver.start()  # what %load_ext does
    mlflow_store()  # (meanwhile: nothing is timed before the server is ready)
    while not forkserver.status()["ready"]:
        time.sleep(0.05)
    tracker_overhead(trials, steps)
    comparison(runs, logged, repeat=2 if args.quick else 4)


if __name__ == "__main__":
    scratch.use()
    main()
