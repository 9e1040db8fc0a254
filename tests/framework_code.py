"""Training code as each framework's users write it (tiny models, data made in memory: no
downloads), used unchanged by test_frameworks. Each returns what the test checks: the world size
the framework saw, and whether every rank ended with the same weights."""
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def data(n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 8, generator=g)
    return TensorDataset(x, x.sum(1, keepdim=True))


def outcome(world_size, weights):
    """The framework's world size, rank 0's weights, and whether every rank holds the same."""
    flat = torch.cat([w.detach().reshape(-1).float() for w in weights])
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, flat)
    return {"world_size": world_size, "weights": flat, "same_on_every_rank": all(torch.equal(g, flat) for g in gathered)}


def lightning(ctx, fail_rank=None, strategy="ddp", epochs=3, pause=0.0, also_log=None, devices=2, num_nodes=1):
    import time

    import lightning as L

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            if self.global_rank == fail_rank and batch_idx == 2:
                raise ValueError("boom in lightning")
            time.sleep(pause)
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            if also_log:
                self.log(also_log, 1.0)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    model = Regression()
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy, max_epochs=epochs,
                        enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(model, DataLoader(data(), batch_size=8))
    return dict(outcome(trainer.world_size, list(model.parameters())), model=model)  # the module itself comes back


def fabric(ctx, fail_rank=None):
    import lightning as L

    f = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
    f.launch()
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    model, optimizer = f.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    loader = f.setup_dataloaders(DataLoader(data(), batch_size=8))
    for _epoch in range(2):
        for i, (x, y) in enumerate(loader):
            if f.global_rank == fail_rank and i == 2:
                raise ValueError("boom in fabric")
            loss = nn.functional.mse_loss(model(x), y)
            f.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        f.log("epoch_loss", loss)
    return outcome(f.world_size, list(model.parameters()))


def accelerate(ctx, fail_rank=None):
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                                   DataLoader(data(), batch_size=8))
    for _epoch in range(2):
        for i, (x, y) in enumerate(loader):
            if accelerator.process_index == fail_rank and i == 2:
                raise ValueError("boom in accelerate")
            loss = nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
    return outcome(accelerator.num_processes, list(accelerator.unwrap_model(model).parameters()))


def transformers(ctx, fail_rank=None, steps=6, pause=0.0):
    import time

    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    class FailOnRank(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if args.process_index == fail_rank and state.global_step == 2:
                raise ValueError("boom in transformers")
            time.sleep(pause)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=100, n_positions=32,
                                       bos_token_id=0, eos_token_id=0))
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 100, (32, 16), generator=g)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4, max_steps=steps, use_cpu=True,
                             report_to=[], logging_steps=1, save_strategy="no", disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=samples, callbacks=[FailOnRank])
    trainer.train()
    return dict(outcome(args.world_size, list(model.parameters())), model=trainer.model)


def accelerate_launched(steps, fail_rank=None):
    """A function for accelerate's notebook_launcher: no rank, no context; makes its own Accelerator."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    if accelerator.process_index == fail_rank:
        raise ValueError("boom in notebook_launcher")
    t = torch.ones(1) * steps
    t = accelerator.reduce(t, reduction="sum")
    return accelerator.num_processes, float(t)


def ignores_stop_and_raises_on_sigterm(ctx):
    """A loop that never looks at ctx.should_stop, in a process whose SIGTERM handler raises, as
    Lightning's does (SIGTERMException)."""
    import signal
    import time

    class SIGTERMException(SystemExit):
        pass

    def on_sigterm(signum, frame):
        raise SIGTERMException(1)

    signal.signal(signal.SIGTERM, on_sigterm)
    step = 0
    while True:
        step += 1
        dist.all_reduce(torch.ones(1))
        ctx.log(step=step)
        time.sleep(0.02)


def accelerate_launcher_inside(ctx):
    """accelerate's own notebook_launcher, called in a launched function."""
    from accelerate import notebook_launcher

    return notebook_launcher(accelerate_launched, args=(3,), num_processes=2)
