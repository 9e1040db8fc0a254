"""Writes the tutorial notebooks from the cells below and executes them, storing outputs.

    .venv/bin/python scripts/build_notebooks.py                        # every notebook
    .venv/bin/python scripts/build_notebooks.py 07_experiments.ipynb   # only the ones named

nbval (in the test suite) then re-runs each notebook and compares the outputs."""
from __future__ import annotations

import os
import sys

import nbformat
from nbclient import NotebookClient

HERE = os.path.dirname(os.path.abspath(__file__))
NOTEBOOKS = os.path.join(HERE, "..", "notebooks")


def md(text):
    return nbformat.v4.new_markdown_cell(text.strip())


def code(text):
    return nbformat.v4.new_code_cell(text.strip())


def raises(text):
    """A cell that raises on purpose: the build keeps going, nbval expects the error."""
    cell = code(text)
    cell.metadata["tags"] = ["raises-exception"]
    return cell


def unchecked(text):
    """A cell whose output nbval does not compare (a figure, ranks' lines in the order they came)."""
    cell = code(text)
    cell.metadata["tags"] = ["nbval-ignore-output"]
    return cell


QUICKSTART = [
    md("""
# Quickstart: DistributedDataParallel from a notebook

`ddp_notebook` runs a DDP fit in background worker processes, one per device, while this kernel
stays responsive. Here: two CPU workers train a small model on synthetic data.
"""),
    code("""
%load_ext ddp_notebook
import torch, ddp_notebook
"""),
    md("Pick the devices. The list is validated before anything starts; `%ddp_devices` makes it the default."),
    code("%ddp_devices cpu*2"),
    md("Synthetic regression data, and a model defined right here in the notebook:"),
    code("""
torch.manual_seed(0)
x = torch.randn(1024, 8)
y = x @ torch.randn(8, 1) + 0.05 * torch.randn(1024, 1)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
"""),
    md("""
Launch the built-in fit. `wait=False` returns the run at once; as the value of a cell it shows
the **live panel**: one row per device with its progress, loss and rate, and a loss plot.
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
run = ddp_notebook.fit(model=model, train_data=(x[:896], y[:896]), valid_data=(x[896:], y[896:]),
                       loss=torch.nn.MSELoss(), optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
                       epochs=8, batch_size=32, wait=False)
run
"""),
    md("`run.wait()` gives the result: the model (the same object, now trained) and the history."),
    code("""
result = run.wait()
first, last = result.history[0]["train_loss"], result.history[-1]["train_loss"]
print("status:", run.status)
print("epochs:", len(result.history), "| every rank holds the same weights:", result.ranks_in_sync)
print("training loss dropped more than 5x:", last < first / 5)
print("the model in this notebook is the trained one:", result.model is model)
"""),
    md("Evaluate the trained model right here, in the notebook process:"),
    code("""
with torch.no_grad():
    mse = torch.nn.functional.mse_loss(model(x[896:]), y[896:]).item()
print("validation MSE below 0.1:", mse < 0.1)
"""),
    md("""
The same fit with the magic: `%ddp_fit` takes a dict of `fit()` arguments (or a training
function) by name, shows the panel and returns at once; `--wait` blocks.
"""),
    code("""
config = dict(model=lambda: torch.nn.Linear(8, 1), train_data=(x, y), loss=torch.nn.MSELoss(),
              optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=32)
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
%ddp_fit config --epochs 3
"""),
    code("""
fit = _ddp_run.wait()
print(_ddp_run.status, "after", len(fit.history), "epochs; ranks in sync:", fit.ranks_in_sync)
"""),
]

FAILURES = [
    md("""
# When a worker fails

Bad device lists are caught before anything starts; a worker that fails is named with its own
error message and traceback; and a single-device retry is one click (or one call) away.
"""),
    code("""
%load_ext ddp_notebook
import os, torch, ddp_notebook
"""),
    md("## Caught by validation\nA duplicate device:"),
    code("%ddp_devices cpu:0,cpu:0"),
    md("A device that does not exist (this machine has no GPU):"),
    code("%ddp_devices cuda:0"),
    md("Data whose shards would be empty (a data problem, named once): 100 samples, 2 workers, batch size 64, "
       "`drop_last=True`:"),
    code("""
x, y = torch.randn(100, 4), torch.randn(100, 1)
try:
    ddp_notebook.fit(model=torch.nn.Linear(4, 1), train_data=(x, y), loss=torch.nn.MSELoss(),
                     batch_size=64, drop_last=True, devices="cpu*2")
except ddp_notebook.FitConfigError as e:
    print(e)
"""),
    md("""
## A worker that raises
`train` raises on rank 1 at step 5. In a live notebook the run's panel turns that worker's row
red and shows a failure card with the message, the traceback and the retry buttons. A page that
shows no widgets (this one, GitHub, nbviewer) keeps the panel's HTML form instead, as it was when
the run ended: each rank's status in words (rank 1 `failed`, rank 0 `knock-on`), the loss plot,
and the same card with a red edge.
"""),
    code("""
import torch.distributed as dist

def train(ctx, steps=40):
    t = torch.ones(1)
    for step in range(1, steps + 1):
        if ctx.rank == 1 and step == 5:
            raise ValueError(f"boom at step {step}")
        dist.all_reduce(t)
        ctx.log(step=step, total=steps, loss=1.0 / step)
    return "trained"
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
run = ddp_notebook.launch(train, devices="cpu:0,cpu:1")
run
"""),
    code("""
try:
    run.wait()
except ddp_notebook.WorkerFailedError as e:
    print(e)
    print("rank:", e.rank, "| device:", e.device, "| kind:", e.failure.kind)
    print("it is the root cause:", not e.failure.consequence, "| no worker left running:", all(w.finished for w in run.workers))
"""),
    md("""
**Retry on a single device**: the card's button does this; from code it is `run.retry()`, which
picks the main device, or the first device that did not fail.
"""),
    code("""
retry = run.retry()
print("retry on", [str(d) for d in retry.devices], "->", retry.wait(), f"({retry.status})")
"""),
    md("## Stop a running fit\n`run.stop()` asks every worker to stop (`ctx.should_stop`); workers that ignore it are terminated after a grace period."),
    code("""
def forever(ctx):
    import time
    step = 0
    while not ctx.should_stop:
        step += 1
        ctx.log(step=step)
        time.sleep(0.01)
    return "stopped cleanly"

import time
long_run = ddp_notebook.launch(forever, devices="cpu*2")
while not all(w.step for w in long_run.workers):   # until both workers are stepping
    time.sleep(0.05)
long_run.stop()
print(long_run.wait(), "->", long_run.status)
"""),
]

OWN_LOOP = [
    md("""
# Your own training loop

A function `train(ctx, ...)` runs on every device. The context gives what a DDP loop needs:
`ctx.prepare(model)`, `ctx.loader(dataset, ...)` (this rank's shard), `ctx.epochs()`,
`ctx.batches()` (progress reporting), `ctx.log(...)`, and checkpoints saved by the main worker.
"""),
    code("""
%load_ext ddp_notebook
import torch, ddp_notebook
from torch.utils.data import TensorDataset
torch.manual_seed(0)
x = torch.randn(512, 8)
data = TensorDataset(x, x.sum(1, keepdim=True))
"""),
    code("""
def train(ctx, dataset, epochs=4, fail_at_epoch=None):
    model = ctx.prepare(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    checkpoint = ctx.load_checkpoint()          # set when the run resumes (retry(resume=True))
    if checkpoint is not None:
        ctx.unwrap(model).load_state_dict(checkpoint["model"])
        start = checkpoint["epoch"] + 1
    loader = ctx.loader(dataset, batch_size=32)
    print(f"rank {ctx.rank} on {ctx.device_name}: {len(loader)} batches an epoch, starting at epoch {start}")
    for epoch in ctx.epochs(epochs, start=start):
        if epoch == fail_at_epoch and ctx.rank == 1 and checkpoint is None:
            raise RuntimeError(f"simulated crash in epoch {epoch}")
        for xb, yb in ctx.batches(loader):
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            opt.zero_grad(); loss.backward(); opt.step()
            ctx.log(loss=loss.item())
        ctx.save_checkpoint({"model": ctx.unwrap(model).state_dict(), "epoch": epoch}, epoch)
    return round(loss.item(), 3) if ctx.is_main else None
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
run = ddp_notebook.launch(train, devices="cpu*2", args=(data,))
run
"""),
    code("""
final_loss = run.wait()
print(run.status, "| final loss below 0.05:", final_loss < 0.05)
"""),
    md("Each worker's output is kept apart, by rank:"),
    code("""
for rank in (0, 1):
    print(run.output(rank), end="")
"""),
    md("""
## Checkpoints and resume
Rank 1 crashes in epoch 2; the main worker had saved epochs 0 and 1. `retry(resume=True)`
continues on one device from the last checkpoint.
"""),
    code("""
crashed = ddp_notebook.launch(train, devices="cpu*2", args=(data,), kwargs={"fail_at_epoch": 2})
try:
    crashed.wait()
except ddp_notebook.WorkerFailedError as e:
    print(e)
print("checkpoints:", [c["epoch"] for c in crashed.state.checkpoints])
"""),
    code("""
resumed = crashed.retry(resume=True)
print("resumed loss below 0.05:", resumed.wait() < 0.05)
print(resumed.output(0), end="")
"""),
]

SCALE_OUT = [
    md("""
# The same fit on an ipyparallel cluster

When one machine is not enough, `ddp_notebook` runs the same `fit` (or your own `fn(ctx)`) on
the engines of an [ipyparallel](https://ipyparallel.readthedocs.io) cluster: one rank per engine,
with the same validation, live panel, failure reports and retries. The engines can be anywhere
ipyparallel can start them (`ipcluster start`, SSH, MPI, Slurm...); here, two local engines.
"""),
    code("""
%load_ext ddp_notebook
import torch, ipyparallel as ipp, ddp_notebook
"""),
    md("Start a cluster of two engines (or connect to a running one with `ipp.Client()`):"),
    code("""
# NBVAL_IGNORE_OUTPUT
cluster = ipp.Cluster(n=2, log_level=40)
rc = cluster.start_and_connect_sync()
"""),
    code("""
print("engines:", rc.ids)
"""),
    md("""
The device list pairs with the engines: rank *r* runs on the *r*-th engine (default: `cpu` on
each). It is validated on the engines themselves before anything starts:
"""),
    code("""
try:
    ddp_notebook.launch(lambda ctx: ctx.rank, engines=rc, devices="cpu*3")
except ddp_notebook.InvalidDevicesError as e:
    print(e.report.errors[0].message)
"""),
    md("The fit from the quickstart, now with `engines=rc`; the panel shows each rank's engine:"),
    code("""
torch.manual_seed(0)
x = torch.randn(1024, 8)
y = x @ torch.randn(8, 1) + 0.05 * torch.randn(1024, 1)

def make_model():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))

settings = dict(train_data=(x, y), loss=torch.nn.MSELoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.05),
                epochs=5, batch_size=32, shuffle=False)
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
run = ddp_notebook.fit(make_model, engines=rc, wait=False, **settings)
run
"""),
    code("""
on_engines = run.wait()
print("status:", run.status, "| ranks in sync:", on_engines.ranks_in_sync)
print("ranks:", [w.place.split(" on ")[0] for w in run.workers])
print("loss dropped more than 5x:", on_engines.history[-1]["train_loss"] < on_engines.history[0]["train_loss"] / 5)
"""),
    md("""
It is the same computation as with local worker processes: the weights agree. A blocking `fit()`
shows its panel while it trains.
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
local = ddp_notebook.fit(make_model, devices="cpu*2", **settings)
"""),
    code("""
print("same weights as two local workers:",
      all(torch.allclose(a, b, atol=1e-6) for a, b in zip(on_engines.model.parameters(), local.model.parameters())))
"""),
    md("""
## A failing engine
A rank that raises is named with its engine; its peer's knock-on error is marked as a
consequence, and the engines are left idle and clean for the next run.
"""),
    code("""
import torch.distributed as dist

def train(ctx, steps=20):
    t = torch.ones(1)
    for step in range(1, steps + 1):
        dist.all_reduce(t)
        if ctx.rank == 1 and step == 5:
            raise ValueError(f"bad batch at step {step}")
        ctx.log(step=step, total=steps, loss=1.0 / step)
    return step

failed = ddp_notebook.launch(train, engines=rc)
try:
    failed.wait()
except ddp_notebook.WorkerFailedError as e:
    print(e)
"""),
    md("The retry runs on the engine of the healthy rank (the panel's *Retry on single device* does the same):"),
    code("""
again = failed.retry()
steps = again.wait()
print(again.status, "after", steps, "steps on", again.workers[0].place.split(" on ")[0])
"""),
    md("The magic takes the client by name:"),
    code("""
def where(ctx):
    return f"rank {ctx.rank} of {ctx.world_size}"
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
%ddp_fit where --engines rc --wait
"""),
    code("""
print(_ddp_run.status, _ddp_run.result())
"""),
    md("Stop the cluster when done:"),
    code("""
rc.close()
cluster.stop_cluster_sync()
"""),
]


SESSIONS = [
    md("""
# Interactive sessions: cells on ranks that stay

A launch runs one function and ends. A **session** keeps its ranks, and their process group,
alive between cells: run a cell on every rank, look at what each rank holds, change a line and
run it again, without starting anything anew. Everything a launch guarantees holds: a rank's
error is named with its traceback and its variables, an interrupt reaches every rank, a rank
that dies ends the session, named, and one click forms it again.
"""),
    code("""
%load_ext ddp_notebook
import torch, ddp_notebook
"""),
    md("""
Form a session of two ranks on CPU. `%ddp_session` returns once every rank is ready (its
process group set up) and shows its run's **live view**, which speaks of a session: a row per
rank with what it does (`idle`, `in cell 3 for 2.1 s`), how the last cell ended, and, while a cell
runs, that Kernel → Interrupt stops it on every rank.
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
%ddp_session cpu*2
"""),
    md("""
`%%ddp` runs a cell on every rank, each in a namespace of its own, kept across cells. `rank`,
`world_size`, `ctx`, `torch` and `dist` are there from the start. The value of the cell's last
expression comes back from each rank, in rank order:
"""),
    code("""
%%ddp
x = torch.arange(4.0) + 10 * rank      # each rank its own x
x.sum().item()
"""),
    md("The next cell finds `x` where the last one left it, on each rank:"),
    code("""
%%ddp
x = x * 2
x.tolist()
"""),
    md("A collective in a cell: the ranks' process group is set up (gloo on CPU), so `dist.all_reduce` sums over both ranks:"),
    code("""
%%ddp
total = x.clone()
dist.all_reduce(total)
total.tolist()
"""),
    md("""
What a rank prints shows live, each line named by its rank (ranks print at their own pace, so
their lines interleave as they come). `--ranks` runs a cell on some ranks only: a rank (`1`), a
list (`0,2`), a range with both ends included (`0-2`) or a slice (`1:`, `::2`):
"""),
    code("""
%%ddp --ranks 1:
print(f"rank {rank} of {world_size}, on {ctx.device}")
"""),
    md("""
## Rich output from the ranks

What a rank displays comes to the cell as it would from a kernel, under a line that names the
rank: `display()` (no import needed on a rank), HTML, images, and matplotlib's figures
(`plt.show()`, or a figure as the cell's value). A cell's value is formatted on its rank: a
large tensor is never sent here only to be printed.
"""),
    code("""
%%ddp --ranks 0
from IPython.display import HTML
display(HTML(f"<b>rank {rank}</b> holds <code>{x.tolist()}</code>"))
"""),
    unchecked("""
%%ddp
import matplotlib.pyplot as plt
plt.figure(figsize=(3, 2))
plt.plot(x.tolist(), marker="o")
plt.title(f"x on rank {rank}")
plt.show()
"""),
    md("""
The functions, classes and modules of the notebook that a cell names go to the ranks with it
(a function defined here travels by value, as a launch sends its function):
"""),
    code("""
def normalize(t):
    return (t - t.mean()) / t.std()
"""),
    code("""
%%ddp
normalize(x).round(decimals=2)
"""),
    md("""
## Push and pull

`%ddp_session` also keeps the session in `_ddp_session` (from Python, `ddp_notebook.session("cpu*2")`
makes one). `push` sends values to every rank's namespace; `pull` brings a name's value back
from each rank, as a list by rank:
"""),
    code("""
session = _ddp_session
session.push(scale=torch.tensor(0.5))
session.run("y = x * scale")
session.pull("y")
"""),
    md("""
## A cell that fails on one rank

Most DDP errors are a shape, a dtype or a device that differs on one rank. Here rank 1's batch
has a row too many. The error names the rank, shows the cell's lines and **what the failed
rank's variables held**; the view above shows the same failure card.
"""),
    raises("""
%%ddp
batch = torch.zeros(8 + rank, 4)      # one row too many on rank 1
if batch.shape[0] != 8:
    raise ValueError(f"a batch of {batch.shape[0]} rows, expected 8")
"""),
    md("""
The session goes on, its namespaces kept: the next cell looks into what each rank holds. The
session's view (its run's, here displayed again; the one under `%ddp_session` is the same, live)
keeps the failure card, folded under a line that names the cell, once another cell has run.
"""),
    code("""
%%ddp
batch.shape[0]
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
session
"""),
    md("""
A session is shown as its run, and says the same in words where widgets do not show
(`%ddp_status` shows the session's run, `_ddp_run`):
"""),
    code("""
%ddp_status
"""),
    md("""
## Interrupts, a rank that dies, and closing

- Kernel → Interrupt while a cell runs interrupts it on every rank (`session.interrupt()` does
  the same from another thread); the session goes on, its namespaces kept.
- A rank that dies (killed, crashed) ends the session with its failure named; the view offers
  **Re-form**, and `session.restart()` (or `%ddp_session --restart`) does the same: the session
  is formed again on the same devices, and the ranks' namespaces are lost.
- `%ddp_session --stop` (or `session.close()`) ends the ranks.
"""),
    code("""
run_id = session.current_run.id
%ddp_session --stop
"""),
    md("""
## Read back from disk

Every cell is kept in the log of the session's run, with the failed rank's error and variables:
after a kernel restart, `%ddp_runs --all` lists the session with its cells, `%ddp_status` names
its failed cell and `%ddp_debug` prints that cell's variables again (here the run just closed,
read back from its log as a later kernel would):
"""),
    code("""
%ddp_status $run_id
"""),
    code("""
%ddp_debug $run_id
"""),
    md("""
## A session on ipyparallel engines

When one machine is not enough, the ranks run on the engines of an ipyparallel cluster, one
rank per engine (here two local engines; see tutorial 4). The cells, their output and the blame
are the same; the engines reach this notebook over TCP, which sends them its requests:
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
import ipyparallel as ipp
cluster = ipp.Cluster(n=2, log_level=40)
rc = cluster.start_and_connect_sync()
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
%ddp_session --engines rc --ui text
"""),
    code("""
%%ddp
t = torch.ones(1) * (rank + 1)
dist.all_reduce(t)
t.item()
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
%ddp_session --stop
rc.close()
cluster.stop_cluster_sync()
"""),
]


EXPERIMENTS = [
    md("""
# Experiments: runs named, compared and tuned

Every run keeps what it was called with (`run.config`), what it logged (`run.metrics`,
`run.history`), and the name and tags you give it. Here: a learning-rate series on the digits
that ship with scikit-learn, compared side by side, sent to TensorBoard, then tuned with Optuna.
"""),
    code("""
%load_ext ddp_notebook
import torch, ddp_notebook
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
"""),
    md("1797 images of handwritten digits, 8x8 pixels each; a fifth of them kept for validation:"),
    code("""
digits = load_digits()
x_train, x_valid, y_train, y_valid = train_test_split(digits.data / 16, digits.target, test_size=0.2,
                                                      stratify=digits.target, random_state=0)
train = (torch.tensor(x_train, dtype=torch.float32), torch.tensor(y_train))
valid = (torch.tensor(x_valid, dtype=torch.float32), torch.tensor(y_valid))
print(len(x_train), "training images,", len(x_valid), "validation images")
"""),
    md("""
A small MLP, built by a function (each rank builds it, seeded by `fit`'s `seed=0`: every run
starts from the same weights), and one function for every fit of this notebook: the learning
rate, and the run's options (`name=`, `tags=`, ...), are its arguments.
"""),
    code("""
def mlp():
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))

def accuracy(outputs, targets):
    return (outputs.argmax(dim=1) == targets).float().mean().item()

def train_mlp(lr, **options):
    return ddp_notebook.fit(mlp, train, valid_data=valid, loss=torch.nn.CrossEntropyLoss(),
                            optimizer=lambda p: torch.optim.SGD(p, lr=lr, momentum=0.9),
                            metrics={"accuracy": accuracy}, epochs=5, batch_size=32, devices="cpu*2",
                            **options)
"""),
    md("""
## A learning-rate series

Four fits, the same but for the learning rate, each named after it and tagged. A name shows in
the panel, `%ddp_runs` and comparisons, and names the run in MLflow or W&B. `wait=False` starts
each one and returns its run at once: the four train side by side.
"""),
    code("""
runs = [train_mlp(lr, name=f"lr={lr}", tags={"sweep": "lr"}, wait=False) for lr in (0.3, 0.1, 0.03, 0.01)]
"""),
    md("""
## Side by side

`ddp_notebook.compare` overlays the runs' curves, one plot per metric, above a table: what
differs between the runs (here the optimizer, whose learning rate is shown in brackets), the
last value of each metric, and the best validation loss. The config the runs share is folded
under the table. Shown while the runs train, it is redrawn in place until they end.
`%ddp_compare` does the same from a magic.
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
ddp_notebook.compare(*runs)
"""),
    md("Once they have ended (`run.wait()` returns each fit's result), the same comparison:"),
    code("""
results = [run.wait() for run in runs]
ddp_notebook.compare(*runs)
"""),
    md("""
`%ddp_runs` lists the runs launched from this notebook's folder, newest first, with what sets
each apart and its monitored metric (`-n 4`: the last four):
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
%ddp_runs -n 4
"""),
    md("""
`.frame()` gives the same runs as a pandas DataFrame, in the shape `mlflow.search_runs` returns
(`run_id`, `name`, `status`, times, then `config.*`, `tags.*`, `metrics.*`): select, sort and
plot them as any DataFrame.
"""),
    code("""
df = ddp_notebook.compare(*runs).frame()
df[["name", "tags.sweep", "metrics.valid_loss.min", "metrics.accuracy"]]
"""),
    code("""
best = df.loc[df["metrics.valid_loss.min"].idxmin()]
print(f"best: {best['name']}, validation loss {best['metrics.valid_loss.min']:.3f}, "
      f"accuracy {best['metrics.accuracy']:.1%}")
"""),
    md("""
## One run, inside

A run's `config` holds the call's arguments by name, summarized (tensors by shape, the model
function by name, the lambda by its text with the values it reads), with `devices`:
"""),
    code("""
run = runs[1]
print(run.name, run.tags)
run.config
"""),
    md("""
`run.metrics`: the last value of each metric rank 0 logged, the best of the monitored one
(`valid_loss.min`) and each rank's peak memory (the rates and memory vary from machine to machine):
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
run.metrics
"""),
    md("`run.history`: one row per epoch, epochs from 0:"),
    code("""
import pandas as pd
pd.DataFrame(run.history)[["epoch", "train_loss", "valid_loss", "accuracy"]].round(4)
"""),
    md("""
## TensorBoard

`report_to="tensorboard"` sends what rank 0 logs to TensorBoard while the run trains (MLflow and
W&B: `"mlflow"`, `"wandb"`, or a list). The same series again:
"""),
    code("""
tb_runs = [train_mlp(lr, name=f"lr={lr}", tags={"sweep": "lr", "tracker": "tensorboard"},
                     report_to="tensorboard", wait=False) for lr in (0.3, 0.1, 0.03, 0.01)]
for run in tb_runs:
    run.wait()
"""),
    md("""
Each run writes its event files in its own folder, `tb/` in the run's directory (`tb/<name>` for
a named run, so that TensorBoard shows its name):
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
import os
tb_dir = os.path.join(tb_runs[1].run_dir, "tb", "lr=0.1")
print(tb_dir)
print(sorted(os.listdir(tb_dir)))
"""),
    md("""
To see them in TensorBoard, point it at the runs folder (every run appears, as
`<run id>/tb/<name>`), or at one run's `tb/`:

```
%load_ext tensorboard
%tensorboard --logdir ~/.cache/ddp_notebook/runs
```

(`$DDP_NOTEBOOK_RUNS` when you set it.) The values are there, as TensorBoard's own reader shows:
each one at its step (batches), and at the end the name, tags and config as hparams, for the
HParams dashboard.
"""),
    code("""
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

events = EventAccumulator(tb_dir).Reload()
print(sorted(events.Tags()["scalars"]))
[(e.step, round(e.value, 4)) for e in events.Scalars("valid_loss")]
"""),
    md("""
## Tuning with Optuna

`fit(..., trial=trial)` reports the monitored value (`valid_loss`) to an Optuna trial after each
epoch (epochs from 0), and when the study's pruner says the trial is worse than the others at
that epoch, it stops the run and raises `optuna.TrialPruned`, which Optuna counts as pruned.
The objective returns the run's best validation loss.
"""),
    code("""
import optuna
optuna.logging.set_verbosity(optuna.logging.WARNING)

def objective(trial):
    lr = trial.suggest_float("lr", 1e-3, 1.0, log=True)
    run = train_mlp(lr, trial=trial, name=f"trial {trial.number}", tags={"sweep": "optuna"}, wait=False)
    run.wait()  # raises optuna.TrialPruned when the trial is pruned
    return run.metrics["valid_loss.min"]
"""),
    md("""
Six trials. The median pruner lets the first two finish, then prunes a trial whose loss is worse
than the median of the finished ones at the same epoch, from the second epoch on. (With
`study.optimize(..., n_jobs=2)` two trials run at once, each waiting for the devices.)
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
study = optuna.create_study(study_name="digits-lr", direction="minimize",
                            sampler=optuna.samplers.TPESampler(seed=0),
                            pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
study.optimize(objective, n_trials=6)
"""),
    md("Which trials were pruned (a pruned trial's value is the last one it reported):"),
    code("""
study.trials_dataframe()[["number", "params_lr", "value", "state"]]
"""),
    code("""
print("best:", study.best_params, f"validation loss {study.best_value:.3f}")
"""),
    md("""
Each trial is a run: the last six runs of this folder are the study's. A pruned run shows as
stopped, its curves ending at the epoch it was pruned at: each epoch waits for the trial's verdict
on the one before (a few milliseconds), so its record holds what the trial was told, and no more:
"""),
    code("""
# NBVAL_IGNORE_OUTPUT
trials = ddp_notebook.compare(last=6, metrics=["valid_loss", "accuracy"])
trials
"""),
    code("""
for state in trials.states:
    print(f"{state.name}: {state.status}, trial {state.config['trial']}, lr {state.config['trial.lr']:.4f}")
"""),
    md("""
## Where runs live

Every run has a folder of its own in the runs folder, `~/.cache/ddp_notebook/runs`
(`$DDP_NOTEBOOK_RUNS` when set): its log, result, checkpoints and `tb/`. The folder keeps the
last 50 runs and 2 GB (`$DDP_NOTEBOOK_KEEP_RUNS`, `$DDP_NOTEBOOK_RUNS_MAX_BYTES`): older finished
runs are removed, except runs with a name or tags, and runs you pin:
"""),
    code("""
best_run = ddp_notebook.Run.load(best["run_id"])   # a run by its id, as after a kernel restart
best_run.pin()
print(best_run.name, best_run.status, "| pinned:", best_run.pinned)
print(f"best validation loss {best_run.metrics['valid_loss.min']:.3f} after {len(best_run.history)} epochs")
"""),
    md("""
After a kernel restart, `%ddp_runs` lists this folder's runs again, `ddp_notebook.Run.load(id)`
reads one back (its config, metrics, history and result), and `ddp_notebook.compare()` without
runs compares every run launched from here. `run.unpin()` lets a run go again; `run.delete()`
removes it now.
"""),
]


# Run last, then removed: every run ended and every widget's final state sent from this cell.
# A panel redraws from its own thread, and nbclient records only the widget updates of the cell
# it is executing, so without this the stored panels would show the first moments of each run;
# likewise a display's fallback, updated by display id from this cell.
FINAL_STATE = """
import time as _time, ipywidgets as _widgets, ddp_notebook as _ddp
for _run in _ddp.runs():
    try:
        _run.wait(timeout=300)
    except Exception:
        pass
_time.sleep(2.5)  # the panels' last redraw (they tick every second)
for _widget in list(_widgets.widgets.widget._instances.values()):
    _widget.send_state()
    if getattr(_widget, "display_handle", None) is not None:  # its fallback, from this cell too
        _widget.display_handle.update(_widget)
"""


def build(name: str, cells: list) -> str:
    nb = nbformat.v4.new_notebook(cells=cells + [code(FINAL_STATE)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = os.path.join(NOTEBOOKS, name)
    NotebookClient(nb, timeout=300, kernel_name="python3", store_widget_state=True,
                   resources={"metadata": {"path": NOTEBOOKS}}).execute()
    nb.cells.pop()
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    todo = {"01_quickstart.ipynb": QUICKSTART, "02_when_a_worker_fails.ipynb": FAILURES,
            "03_your_own_loop.ipynb": OWN_LOOP, "04_scale_out.ipynb": SCALE_OUT,
            "06_interactive_sessions.ipynb": SESSIONS,
            "07_experiments.ipynb": EXPERIMENTS}
    for name in sys.argv[1:] or todo:
        print("built", build(name, todo[name]))
