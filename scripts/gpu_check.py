"""GPU acceptance check for the engine, run on a machine with exactly one CUDA GPU:

    .venv/bin/python scripts/gpu_check.py

1. a cuda:0 run works (nccl process group, tensors on the GPU, result back);
2. cuda:0,cuda:1 is refused by validation before anything starts;
3. the calling process still has no CUDA context afterwards;
4. the run records rank 0's peak CUDA allocation (``run.metrics["rank0.peak_cuda"]``, 4 MiB at least).
Prints one PASS/FAIL line per check; exits non-zero on any failure.
"""
from __future__ import annotations

import sys
import tempfile

import torch

import ddp_notebook


def train(ctx):
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device=ctx.device) * (ctx.rank + 1)
    held = torch.empty(2**20, device=ctx.device)  # 4 MiB: the peak the run must record
    del held
    dist.all_reduce(t)
    ctx.log(step=1, total=1)
    return {"device": str(t.device), "backend": dist.get_backend(), "sum": t.sum().item(),
            "current": torch.cuda.current_device()}


def main() -> int:
    failures = 0

    def check(name: str, ok: bool, detail: str = "") -> None:
        nonlocal failures
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}" + (f": {detail}" if detail else ""), flush=True)

    root = tempfile.mkdtemp()
    report = ddp_notebook.validate_devices("cuda:0")
    check("cuda:0 validates", report.ok, str(report))
    try:
        run = ddp_notebook.launch(train, devices="cuda:0", run_root=root)
        out = run.wait(timeout=300)
        check("cuda:0 run", out == {"device": "cuda:0", "backend": "nccl", "sum": 4.0, "current": 0}, repr(out))
        peak = run.metrics.get("rank0.peak_cuda")
        check("the run records rank 0's peak CUDA allocation", isinstance(peak, int) and peak >= 4 * 2**20, repr(peak))
    except ddp_notebook.DDPNotebookError as e:
        check("cuda:0 run", False, str(e))
    n = ddp_notebook.validate_devices("cuda").devices
    try:
        ddp_notebook.launch(train, devices="cuda:0,cuda:1", run_root=root)
        check("cuda:0,cuda:1 refused on a 1-GPU machine", len(n) > 1, f"{len(n)} GPU(s) visible")
    except ddp_notebook.InvalidDevicesError as e:
        check("cuda:0,cuda:1 refused on a 1-GPU machine", "cuda:1 does not exist: 1 CUDA device is visible" in str(e), str(e))
    check("no CUDA context in the calling process", not torch.cuda.is_initialized())
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
