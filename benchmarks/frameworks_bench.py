"""The frameworks' own notebook launchers next to ddp_notebook, on the same failure.

Each trial is a fresh Python process (a notebook) that trains a tiny model on 2 CPU ranks and
has rank 1 raise ``ValueError`` at its third batch: with Lightning's ``Trainer(strategy=
"ddp_notebook")`` (it forks the notebook), with accelerate's ``notebook_launcher`` (it forks too,
under torch elastic), and with the same code under ddp_notebook (``launch`` for the Lightning
code, ``ddp_notebook.integrations.accelerate.notebook_launcher`` for accelerate's). Recorded:
which rank the error the notebook gets names as the failure (the raising rank writes its rank and
the time before it raises), the seconds from the raise until the notebook has that error, whether
the error shows the ValueError's message, and whether a second launch in the same notebook then
succeeds.

    .venv/bin/python benchmarks/frameworks_bench.py            # 5 trials each
    .venv/bin/python benchmarks/frameworks_bench.py --quick    # 1 trial each

It needs the frameworks (``pip install -e ".[lightning,hf]"``; the test extras have them) and is
run on its own, not by ``run.py``: each trial imports Lightning or accelerate afresh.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time

import scratch  # (benchmarks/scratch.py)

LAUNCHERS = {
    "lightning": "Lightning `Trainer(strategy=\"ddp_notebook\")`",
    "ours-lightning": "the same Trainer code in `ddp_notebook.launch`",
    "accelerate": "accelerate `notebook_launcher`",
    "ours-accelerate": "`ddp_notebook.integrations.accelerate.notebook_launcher`",
}
MARK = os.path.join(tempfile.gettempdir(), f"frameworks-bench-{os.getpid()}")


def lightning_code(fail_rank, strategy):
    import lightning as L
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    class Regression(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, batch_idx):
            if self.global_rank == fail_rank and batch_idx == 2:
                raise_here(self.global_rank)
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    x = torch.randn(64, 8)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, enable_progress_bar=False,
                        logger=False, enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(Regression(), DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))


def accelerate_code(fail_rank):
    import torch
    import torch.nn as nn
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator(cpu=True)
    model = nn.Linear(8, 1)
    x = torch.randn(64, 8)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05),
                                                   DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8))
    for i, (xb, yb) in enumerate(loader):
        if accelerator.process_index == fail_rank and i == 2:
            raise_here(accelerator.process_index)
        accelerator.backward(nn.functional.mse_loss(model(xb), yb))
        optimizer.step()
        optimizer.zero_grad()


def raise_here(rank):
    with open(MARK, "w") as f:
        f.write(f"{rank} {time.time()}")
    raise ValueError(f"bad batch on rank {rank}")


def _ours_lightning(ctx, fail_rank):
    lightning_code(fail_rank, "ddp")


def one(launcher: str) -> dict:
    """In this fresh process: one failing launch, then one clean launch."""
    def attempt(fail_rank):
        if launcher == "lightning":
            lightning_code(fail_rank, "ddp_notebook")
        elif launcher == "accelerate":
            from accelerate import notebook_launcher

            notebook_launcher(accelerate_code, args=(fail_rank,), num_processes=2)
        elif launcher == "ours-lightning":
            import ddp_notebook

            ddp_notebook.launch(_ours_lightning, devices="cpu*2", args=(fail_rank,)).wait(timeout=300)
        else:
            from ddp_notebook.integrations.accelerate import notebook_launcher

            notebook_launcher(accelerate_code, args=(fail_rank,), num_processes=2)

    try:
        attempt(1)
        error, text, failure_rank = None, "", None
    except BaseException as exc:  # noqa: BLE001 - what the notebook gets is the measurement
        error, text = exc, f"{type(exc).__name__}: {exc}"
        failure_rank = getattr(getattr(exc, "failure", None), "rank", None)
    known = time.time()
    with open(MARK) as f:
        raised_rank, raised_at = f.read().split()
    blamed = failure_rank if failure_rank is not None else _named_rank(text)
    try:
        attempt(None)
        again = "yes"
    except BaseException as exc:  # noqa: BLE001
        again = f"no ({type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''})"
    return {"raised": int(raised_rank), "blamed": blamed, "seconds": known - float(raised_at),
            "message": "bad batch on rank" in text, "error": type(error).__name__ if error else None, "again": again}


def _named_rank(text: str):
    """The rank a launcher's error names as the failure, read from its text (its own words)."""
    for pattern in (r"Root Cause \(first observed failure\):\s*\[0\]:.*?rank\s*:\s*(\d+)",  # torch elastic
                    r"Process (\d+) terminated with the following error",  # torch.multiprocessing
                    r"process (\d+) terminated with exit code"):
        found = re.search(pattern, text, re.S)
        if found:
            return int(found.group(1))
    return None


def measure(launcher: str, timeout: float) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--one", launcher], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, DDP_NOTEBOOK_PROGRESS="0"))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"failed": (proc.stderr.strip().splitlines() or ["no outcome"])[-1][:120]}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--one")
    opts = parser.parse_args()
    if opts.one:
        print(json.dumps(one(opts.one)))
        return
    trials = 1 if opts.quick else 5
    print("| launcher | rank blamed (rank 1 raised) | raise → the notebook knows | the error shows the "
          "exception's message | a second launch in the same notebook |")
    print("|---|---|---|---|---|")
    for launcher, name in LAUNCHERS.items():
        got = []
        for _ in range(trials):
            try:
                got.append(measure(launcher, timeout=300))
            except subprocess.TimeoutExpired:
                got.append({"failed": "hung: no outcome after 300 s"})
        done = [g for g in got if "failed" not in g]
        if not done:
            print(f"| {name} | {got[0]['failed']} | | | |")
            continue
        right = sum(g["blamed"] == g["raised"] for g in done)
        wrong = ["none" if g["blamed"] is None else f"rank {g['blamed']}" for g in done if g["blamed"] != g["raised"]]
        blamed = f"right {right}/{len(done)}" + (f" (blamed: {', '.join(wrong)})" if wrong else "")
        seconds = sorted(g["seconds"] for g in done)[len(done) // 2]
        message = sum(g["message"] for g in done)
        again = sorted({g["again"] for g in done})
        print(f"| {name} | {blamed} | {seconds:.2f} s | {message}/{len(done)} | {'; '.join(again)} |")
    print(f"\n{os.cpu_count()} cores; medians of {trials}; each trial a fresh process.")


if __name__ == "__main__":
    scratch.use()
    main()
