"""The training function of the terminal demo (``python -m ddp_notebook demo``): two CPU workers
train a tiny MLP with DistributedDataParallel on synthetic data.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["train_demo"]


def train_demo(ctx: Any, epochs: int = 3, samples: int = 4096, batch_size: int = 64,
               fail_rank: Optional[int] = None) -> Optional[dict[str, Any]]:
    """A DDP training function: ``fn(ctx, ...)`` as ``ddp_notebook.launch`` calls it."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    torch.manual_seed(0)
    x = torch.randn(samples, 16)
    y = x @ torch.randn(16, 1) + 0.1 * torch.randn(samples, 1)
    data = TensorDataset(x, y)
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=ctx.world_size, rank=ctx.rank,
                                                          shuffle=True)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.02)
    total = epochs * len(loader)
    step = 0
    for epoch in ctx.epochs(epochs):  # the views count epochs from 1: "epoch 3/3" is the last
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
            ctx.log(step=step, total=total, loss=loss.item())
    return {k: v.clone() for k, v in model.module.state_dict().items()} if ctx.is_main else None
