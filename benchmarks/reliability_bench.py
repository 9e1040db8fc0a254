"""Clean-run reliability: clean DDP runs, half of them after the parent imported torch._dynamo;
counts hangs and runs misreported as failed, for ddp_notebook and torch.multiprocessing fork.

    .venv/bin/python benchmarks/reliability_bench.py            # 50 runs each (25 + 25)
    .venv/bin/python benchmarks/reliability_bench.py --quick    # 4 runs each
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import scratch  # (benchmarks/scratch.py)

HANG_S = 30.0  # a clean 5-step run takes well under a second; 30 s without an end is a hang


def _train(rank: int) -> float:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def _ours(ctx):
    return _train(ctx.rank)


def _fork_rank(rank, init_file):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2)
    _train(rank)


def one_ours() -> str:
    import ddp_notebook

    run = ddp_notebook.launch(_ours, devices="cpu*2")
    try:
        run.wait(HANG_S)
        return "ok"
    except ddp_notebook.errors.WaitTimeoutError:
        run.stop(grace=0, wait=True)
        return "hang"
    except ddp_notebook.DDPNotebookError:
        return "misreported"


def one_fork() -> str:
    import torch.multiprocessing as mp
    from torch.multiprocessing.spawn import ProcessException

    ctx = mp.start_processes(_fork_rank, args=(os.path.join(tempfile.mkdtemp(), "rdv"),), nprocs=2, join=False,
                             start_method="fork")
    deadline = time.monotonic() + HANG_S
    try:
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                for p in ctx.processes:
                    p.kill()
                    p.join()
                return "hang"
        return "ok"
    except ProcessException:
        return "misreported"


def part(dynamo: bool, runs: int) -> dict:
    import torch

    if dynamo:
        import torch._dynamo  # noqa: F401 - what a notebook that used torch.compile has done

    from ddp_notebook.executors.local import forkserver

    forkserver.start()  # what %load_ext does
    counts = {name: {"ok": 0, "hang": 0, "misreported": 0} for name in ("ddp_notebook", "fork")}
    for _ in range(runs):
        counts["ddp_notebook"][one_ours()] += 1
        counts["fork"][one_fork()] += 1
    return counts


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--quick", "--smoke", action="store_true")  # --smoke: the CI smoke test
    parser.add_argument("--part", choices=("plain", "dynamo"))
    args = parser.parse_args()
    if args.part:
        print(json.dumps(part(args.part == "dynamo", args.runs)))
        return
    runs = 4 if args.quick else args.runs
    env = dict(os.environ, DDP_NOTEBOOK_RUNS=tempfile.mkdtemp())
    total = {name: {"ok": 0, "hang": 0, "misreported": 0} for name in ("ddp_notebook", "fork")}
    for which in ("plain", "dynamo"):
        out = subprocess.run([sys.executable, __file__, "--part", which, "--runs", str(runs // 2)],
                             capture_output=True, text=True, env=env, timeout=runs * 2 * HANG_S + 300)
        if out.returncode != 0:
            raise SystemExit(out.stderr)
        for name, counts in json.loads(out.stdout.strip().splitlines()[-1]).items():
            for k, v in counts.items():
                total[name][k] += v
    print(f"Clean-run reliability: {runs} clean 2-rank DDP runs per launcher, half after the parent "
          "imported torch._dynamo")
    print()
    print("| launcher | clean | hangs | misreported as failed |")
    print("|---|---|---|---|")
    for name, c in total.items():
        print(f"| {name} | {c['ok']} | {c['hang']} | {c['misreported']} |")


if __name__ == "__main__":
    scratch.use()
    main()
