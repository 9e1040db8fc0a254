"""A small DDP fit to show the engine at work: ``python -m ddp_notebook demo``.

Two CPU workers train a tiny MLP with DistributedDataParallel on synthetic data; progress
of every rank prints in the terminal while it runs.
"""
from __future__ import annotations

import argparse
import sys
from typing import Optional

__all__ = ["train_demo", "main"]


def train_demo(ctx, epochs: int = 3, samples: int = 4096, batch_size: int = 64, fail_rank: Optional[int] = None):
    """A DDP training function: ``fn(ctx, ...)`` as ``ddp_notebook.launch`` calls it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(samples, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(samples, 1)
    data = TensorDataset(x, y)
    sampler = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    total = epochs * len(loader)
    step = 0
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            if ctx.should_stop:
                return None
            step += 1
            if fail_rank == ctx.rank and step == total // 2:
                raise ValueError(f"boom at step {step}")
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log(step=step, total=total, epoch=epoch, loss=loss.item())
    return {k: v.clone() for k, v in model.module.state_dict().items()} if ctx.is_main else None


def main(argv: Optional[list[str]] = None) -> int:
    import ddp_notebook
    from ddp_notebook.textview import format_run

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
    last = ""
    while not run.done:
        try:
            run.wait(timeout=0.5)
        except ddp_notebook.WaitTimeoutError:
            pass
        except ddp_notebook.DDPNotebookError:
            break
        text = format_run(run.state)
        if text != last and not run.done:
            print(text, flush=True)
            last = text
    try:
        weights = run.wait()
    except ddp_notebook.WorkerFailedError as e:
        print("".join(line + "\n" for line in e._render_traceback_()), file=sys.stderr)
        return 1
    print(format_run(run.state))
    print(f"trained weights back in this process: {sorted(weights)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
