"""DDP code written the way PyTorch's DDP tutorial writes it (used unchanged by the spawn tests)."""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
from torch.nn.parallel import DistributedDataParallel as DDP


def setup(rank, world_size):
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "12355")
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def cleanup():
    dist.destroy_process_group()


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


def demo_basic(rank, world_size, fail_rank=None):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    model = ToyModel().to("cpu")
    ddp_model = DDP(model)
    loss_fn = nn.MSELoss()
    optimizer = optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    outputs = ddp_model(torch.randn(20, 10))
    if rank == fail_rank:
        raise ValueError(f"bad batch on rank {rank}")
    labels = torch.randn(20, 5)
    loss_fn(outputs, labels).backward()
    optimizer.step()
    weight = ddp_model.module.net1.weight.detach().clone()
    cleanup()
    return (rank, world_size, weight.sum().item())


def waits_for_stop(rank, world_size):
    """Sets up its process group as the tutorial does, then waits until the run is stopped."""
    import time

    import ddp_notebook

    setup(rank, world_size)
    dist.barrier()
    ctx = ddp_notebook.current_context()
    ctx.log(step=1)
    while not ctx.should_stop:
        time.sleep(0.05)


def hardcoded_port(rank, world_size, port):
    """Sets MASTER_PORT itself, as PyTorch's tutorial does (os.environ[...] = ...)."""
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    t = torch.ones(1)
    dist.all_reduce(t)
    dist.destroy_process_group()
    return t.item()


def blocks_on_port(rank, world_size, port):
    """Meets on a fixed MASTER_PORT, says it is up, then blocks (it cannot see ctx.should_stop)
    for two minutes."""
    import time

    import ddp_notebook

    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    ddp_notebook.current_context().log(step=1)
    deadline = time.monotonic() + 120  # (a test waits for its interrupt this long, then fails)
    while time.monotonic() < deadline:
        time.sleep(0.1)
    raise TimeoutError("blocked for 120 s: no interrupt ended this run")


def puts_in_queue(rank, queue, nbytes):
    """Sends a result back through a multiprocessing queue, as mp.spawn examples do."""
    queue.put((rank, torch.full((nbytes // 4,), float(rank))))
    queue.put(f"rank {rank} done")


def gets_from_queue(rank, queue, timeout=None):
    import queue as queues

    try:
        item = queue.get(timeout=timeout) if timeout is not None else queue.get()
    except queues.Empty:
        return "empty"
    size, empty = queue.qsize(), queue.empty()
    queue.put(rank)
    return item, size, empty


def tough_nut_function(queue):
    """accelerate's tests/test_notebook.py: fails while its queue holds a number above 0."""
    if queue.empty():
        return
    trial = queue.get()
    if trial > 0:
        queue.put(trial - 1)
        raise RuntimeError("The queue still not empty.")


def torchrun_main(total_epochs=2, backend="gloo"):
    """pytorch/examples' multigpu_torchrun.py: everything from the environment torchrun sets."""
    dist.init_process_group(backend=backend)
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    model = DDP(ToyModel())
    optimizer = optim.SGD(model.parameters(), lr=0.01)
    for epoch in range(total_epochs):
        torch.manual_seed(epoch * 100 + local_rank)  # each rank its own batch
        optimizer.zero_grad()
        nn.MSELoss()(model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
        optimizer.step()
    weights = [p.detach().clone() for p in model.module.parameters()]
    result = (int(os.environ["RANK"]), dist.get_world_size(), float(sum(w.sum() for w in weights)))
    dist.destroy_process_group()
    return result


def exits_on(rank, bad_rank, code):
    """Leaves with os._exit(code) on ``bad_rank``; its peer waits in a collective."""
    setup(rank, 2)
    if rank == bad_rank:
        os._exit(code)
    dist.barrier()


def stores_result(rank, results):
    """Puts its result in a multiprocessing Manager's dict, as mp.spawn examples do."""
    results[rank] = rank * 10
