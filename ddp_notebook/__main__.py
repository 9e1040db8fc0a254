"""``python -m ddp_notebook demo [--devices cpu*2] [--epochs N] [--fail-rank 1]``: a 2-worker DDP fit
with every rank's progress printed in the terminal while it runs."""
from __future__ import annotations

import argparse
import sys
from typing import Optional

import ddp_notebook
from ddp_notebook.recipes.demo import train_demo
from ddp_notebook.ui.terminal import watch


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ddp_notebook demo", description=__doc__)
    parser.add_argument("--devices", default="cpu*2", help="device list (default: cpu*2)")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--fail-rank", type=int, default=None, help="make this rank raise halfway")
    args = parser.parse_args(argv)
    report = ddp_notebook.validate_devices(args.devices)
    print(report)
    if not report.ok:
        return 2
    run = ddp_notebook.launch(train_demo, devices=args.devices,
                              kwargs={"epochs": args.epochs, "fail_rank": args.fail_rank})
    print(f"event log: {run.run_dir}/events.jsonl")
    finish = watch(run, sys.stdout)  # in place on a terminal, a line per change in a log
    try:
        weights = run.wait()
    except ddp_notebook.WorkerFailedError as e:
        finish()
        print("".join(line + "\n" for line in e._render_traceback_()), file=sys.stderr)
        return 1
    finish()
    print(f"trained weights back in this process: {sorted(weights)}")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args and args[0] == "demo":
        args = args[1:]
    sys.exit(main(args))
