"""The benchmark suite's quick mode, as a smoke test (no timing assertions)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

RUN = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")


def test_benchmark_suite_quick_mode_prints_every_table():
    out = subprocess.run([sys.executable, RUN, "--quick"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    tables = [block for block in out.stdout.split("\n\n") if block.startswith("| ")]
    assert len(tables) == 8, out.stdout
    launch, fit, overhead, reliability, engines, relaunch, data, result = tables
    assert launch.splitlines()[2].startswith("| ddp_notebook, fork server started by the launch |")
    assert all(len(row.split("|")) == 9 for row in launch.splitlines())
    assert fit.splitlines()[-1].endswith("| 1.00x |")
    assert overhead.splitlines()[2].startswith("| none |") and "ctx.log itself costs" in out.stdout
    assert reliability.splitlines()[2].startswith("| ddp_notebook | 4 | 0 | 0 |")  # 4 clean runs, none lost
    assert [row.split("|")[1].strip() for row in engines.splitlines()[2:]] == [
        "ipyparallel engines (warm), ddp_notebook", "local workers, ddp_notebook warm pool",
        "torch.multiprocessing fork", "torch.multiprocessing spawn"]
    assert [row.split("|")[1].strip() for row in relaunch.splitlines()[2:]] == [
        "ddp_notebook, fork server (default)", "ddp_notebook, fork server started by `%load_ext`",
        "ddp_notebook, warm pool, fork server off", "torch.multiprocessing fork", "torch.multiprocessing spawn"]
    assert all(row.endswith("| 0 of 10 |") for row in relaunch.splitlines()[2:4]), relaunch  # no hang
    assert [row.split("|")[1].strip() for row in data.splitlines()[2:]] == [
        "floor: one copy into fresh shared memory, read by waiting processes (no launcher)",
        "ddp_notebook (fork server warm)", "ddp_notebook, data from `ddp_notebook.share`", "torch.multiprocessing spawn",
        "torch.multiprocessing fork"] * 2  # 1 MB, then 64 MB
    assert "| ddp_notebook (fork server warm) | 2 | 64 MB |" in data and result.count("\n") == 4
