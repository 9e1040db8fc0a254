"""The benchmark suite's quick mode, as a smoke test (no timing assertions)."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

RUN = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")


def test_benchmark_suite_smoke_mode_prints_every_table():
    # --smoke is --quick without the rows that only add fresh interpreters (torch.multiprocessing
    # spawn, the warm pool without a fork server) or a known hang's minute (fork on the data
    # benchmark): every script and every table, in a third of the time.
    out = subprocess.run([sys.executable, RUN, "--smoke"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    tables = [block for block in out.stdout.split("\n\n") if block.startswith("| ")]
    assert len(tables) == 8, out.stdout
    launch, fit, overhead, reliability, engines, relaunch, data, result = tables
    assert [row.split("|")[1].strip() for row in launch.splitlines()[2:]] == [
        "ddp_notebook, fork server started by the launch", "torch.multiprocessing fork"]
    assert all(len(row.split("|")) == 9 for row in launch.splitlines())
    assert fit.splitlines()[-1].endswith("| 1.00x |")
    assert overhead.splitlines()[2].startswith("| none |") and "ctx.log itself costs" in out.stdout
    assert reliability.splitlines()[2].startswith("| ddp_notebook | 4 | 0 | 0 |")  # 4 clean runs, none lost
    assert [row.split("|")[1].strip() for row in engines.splitlines()[2:]] == [
        "ipyparallel engines (warm), ddp_notebook", "local workers, ddp_notebook warm pool",
        "torch.multiprocessing fork"]
    assert [row.split("|")[1].strip() for row in relaunch.splitlines()[2:]] == [
        "ddp_notebook, fork server (default)", "ddp_notebook, fork server started by `%load_ext`",
        "torch.multiprocessing fork"]
    assert all(row.endswith("| 0 of 10 |") for row in relaunch.splitlines()[2:]), relaunch  # no hang
    data_rows = data.splitlines()[2:]
    assert [row.split("|")[1].strip() for row in data_rows] == [
        "floor: one copy into fresh shared memory, read by waiting processes (no launcher)",
        "ddp_notebook (fork server warm)", "ddp_notebook, data from `ddp_notebook.share`"] * 2  # 1 MB, then 64 MB
    measured = re.compile(r"^\d+\.\d+ s( \(\d+\.\d+ s/GB\))?$")  # not "hung: no outcome after 60 s"
    assert all(measured.match(row.split("|")[4].strip()) for row in data_rows), data
    assert [row.split("|")[1].strip() for row in result.splitlines()[2:]] == [
        "ddp_notebook (fork server warm)", "torch.multiprocessing fork"]
    assert all(measured.match(row.split("|")[2].strip()) for row in result.splitlines()[2:]), result
