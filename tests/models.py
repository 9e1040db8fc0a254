"""Models and data for the fit tests (importable by the worker processes)."""
import os

import torch


def regression_data(n=512, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, 1, generator=g)
    return x, x @ w + 0.05 * torch.randn(n, 1, generator=g)


def linear(d=8):
    return torch.nn.Linear(d, 1)


class FailsOnRank1(torch.nn.Module):
    """A linear model whose forward raises on rank 1 once ``fail_after`` batches were seen."""

    def __init__(self, d=8, fail_after=10**9):
        super().__init__()
        self.lin = torch.nn.Linear(d, 1)
        self.fail_after = fail_after
        self.seen = 0

    def forward(self, x):
        if self.training:
            self.seen += 1
        if os.environ.get("RANK") == "1" and self.seen > self.fail_after:
            raise ValueError(f"bad batch {self.seen} on rank 1")
        return self.lin(x)


def sgd(lr):
    return lambda params: torch.optim.SGD(params, lr=lr)


def within(tol):
    return lambda pred, y: ((pred - y).abs() < tol).float().mean()


class HeldAfter(torch.nn.Module):
    """A linear model whose training forward waits, once ``after`` batches were seen, for as long
    as the file ``hold`` exists (a run to cut off mid-epoch at a known point)."""

    def __init__(self, hold, after, d=8):
        super().__init__()
        self.lin = torch.nn.Linear(d, 1)
        self.hold, self.after, self.seen = hold, after, 0

    def forward(self, x):
        if self.training:
            self.seen += 1
            while self.seen > self.after and os.path.exists(self.hold):
                import time

                time.sleep(0.05)
        return self.lin(x)


def constant(value):
    """A metric that never changes (early stopping on it stops after its patience)."""
    return lambda pred, y: torch.tensor(float(value))


class DropoutNet(torch.nn.Module):
    """A small net with dropout (it draws random numbers every training step); rank 1 raises after
    ``after`` batches while the file ``fail_while`` exists."""

    def __init__(self, fail_while=None, after=0, d=8):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(d, 16), torch.nn.Dropout(0.5), torch.nn.Linear(16, 1))
        self.fail_while, self.after, self.seen = fail_while, after, 0

    def forward(self, x):
        if self.training:
            self.seen += 1
            if (os.environ.get("RANK") == "1" and self.fail_while and self.seen > self.after
                    and os.path.exists(self.fail_while)):
                raise ValueError(f"bad batch {self.seen} on rank 1")
        return self.net(x)
