"""The context's training helpers in a custom loop: shards, progress, agreed stop, checkpoints."""
import os

import pytest
import torch

import ddp_notebook

from helpers import wait_for

pytestmark = pytest.mark.processes


def shard_indices(ctx, n, epochs):
    from torch.utils.data import TensorDataset

    loader = ctx.loader(TensorDataset(torch.arange(n)), batch_size=4, shuffle=True)
    seen = []
    for _epoch in ctx.epochs(epochs):
        seen.append([int(i) for (batch,) in ctx.batches(loader) for i in batch])
    out = [None] * ctx.world_size
    torch.distributed.all_gather_object(out, seen)
    return out


def test_loader_shards_are_disjoint_and_reshuffled_each_epoch():
    per_rank = ddp_notebook.launch(shard_indices, devices="cpu*2", args=(24, 2)).wait(timeout=60)
    for epoch in range(2):
        a, b = per_rank[0][epoch], per_rank[1][epoch]
        assert len(a) == len(b) == 12 and sorted(a + b) == list(range(24))
    assert per_rank[0][0] != per_rank[0][1]  # set_epoch was called: a new order each epoch


def test_epochs_and_batches_report_progress():
    run = ddp_notebook.launch(shard_indices, devices="cpu*2", args=(24, 2))
    run.wait(timeout=60)
    for w in run.workers:
        assert (w.step, w.total, w.epoch) == (6, 6, 1) and w.metrics["samples_per_s"] > 0


def loop_until_stopped(ctx):
    model = ctx.prepare(torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    from torch.utils.data import TensorDataset

    loader = ctx.loader(TensorDataset(torch.randn(64, 2), torch.randn(64, 1)), batch_size=8)
    for epoch in ctx.epochs(10**6):
        for x, y in ctx.batches(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log(loss=loss.item())
        ctx.save_checkpoint({"epoch": epoch}, epoch)
    return ctx.step


def test_stop_is_agreed_so_every_rank_leaves_at_the_same_step():
    run = ddp_notebook.launch(loop_until_stopped, devices="cpu*2", stop_grace=30)
    wait_for(run, lambda s: all((w.epoch or 0) >= 1 for w in s.workers.values()))
    run.stop()
    last_step = run.wait(timeout=60)
    assert run.status == "stopped" and [w.status for w in run.workers] == ["stopped", "stopped"]
    assert last_step >= 4  # the first epoch (4 steps a rank) had ended: the stop came in the second
    checkpoints = [e for e in run.events if e["kind"] == "checkpoint"]
    assert checkpoints and all(e["rank"] == 0 for e in checkpoints)  # saved by the main worker only
    assert os.path.exists(checkpoints[-1]["path"])
    assert open(os.path.join(run.checkpoint_dir, "latest")).read() == os.path.basename(checkpoints[-1]["path"])


def test_prepare_wraps_in_ddp_only_with_peers():
    def kinds(ctx):
        return type(ctx.prepare(torch.nn.Linear(1, 1))).__name__

    assert ddp_notebook.launch(kinds, devices="cpu*2").wait(timeout=60) == "DistributedDataParallel"
    assert ddp_notebook.launch(kinds, devices="cpu:0").wait(timeout=60) == "Linear"


def test_batches_move_every_tensor_of_a_batch_to_the_ranks_device():  # (no process: the module marks it)
    import collections

    import torch

    from ddp_notebook.worker.context import _to_device

    Pair = collections.namedtuple("Pair", "x y")
    batch = (torch.ones(2), [torch.zeros(1), "label"], {"mask": torch.ones(3)}, Pair(torch.ones(1), 7))
    moved = _to_device(batch, torch.device("meta"))  # a device of its own, without a GPU
    assert moved[0].device.type == moved[1][0].device.type == moved[2]["mask"].device.type == "meta"
    assert moved[1][1] == "label" and isinstance(moved[3], Pair) and moved[3].x.is_meta and moved[3].y == 7
    assert batch[0].device.type == "cpu"  # the loader's batch itself is left as it was
