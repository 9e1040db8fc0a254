"""The benchmark suite's quick mode, as a smoke test (no timing assertions)."""
import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

RUN = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "run.py")
MEASURED = re.compile(r"^\d+\.\d+ s( \(\d+\.\d+ s/GB\))?$")
# What a table says of a launcher that hung (data_bench.py), and of the bigger data after that.
HUNG = re.compile(r"^hung: no outcome after \d+ s$|^not run: it hung with less data$")


def ours(row):
    """Whether a table's row is one of ddp_notebook's, not a baseline's (torch.multiprocessing, the
    floor of a copy with no launcher): a baseline that hangs is a measurement of it, not our defect."""
    return "ddp_notebook" in row.split("|")[1]


def measured_or_hung(rows, column):
    """Each row's ``column`` is a time; a baseline's may say it hung instead."""
    for row in rows:
        value = row.split("|")[column].strip()
        assert MEASURED.match(value) or (not ours(row) and HUNG.match(value)), row


def test_benchmark_suite_smoke_mode_prints_every_table():
    # --smoke is --quick without the rows that only add fresh interpreters (torch.multiprocessing
    # spawn, the warm pool without a fork server) or a known hang's minute (fork on the data
    # benchmark): every script and every table, in a third of the time.
    out = subprocess.run([sys.executable, RUN, "--smoke"], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr
    tables = [block for block in out.stdout.split("\n\n") if block.startswith("| ")]
    assert len(tables) == 11, out.stdout
    launch, fit, overhead, reliability, engines, relaunch, data, result, trackers, comparison, first_error = tables
    assert [row.split("|")[1].strip() for row in first_error.splitlines()[2:]] == [
        "`ddp_notebook.launch` (+ `wait()`)", "accelerate `notebook_launcher`"]
    assert "main worker (cpu:0) failed: ValueError: rank 0 raised" in first_error.splitlines()[2]
    assert [row.split("|")[1].strip() for row in launch.splitlines()[2:]] == [
        "ddp_notebook, fork server started by the launch", "torch.multiprocessing fork"]
    assert all(len(row.split("|")) == 9 for row in launch.splitlines())
    assert fit.splitlines()[-1].endswith("| 1.00x |")
    assert overhead.splitlines()[2].startswith("| none |") and "ctx.log itself costs" in out.stdout
    assert reliability.splitlines()[2].startswith("| ddp_notebook | 4 | 0 | 0 |")  # 4 clean runs, none lost
    assert [row.split("|")[1].strip() for row in engines.splitlines()[2:]] == [
        "ipyparallel engines (warm), ddp_notebook", "local workers, ddp_notebook fork server",
        "torch.multiprocessing fork"]
    assert [row.split("|")[1].strip() for row in relaunch.splitlines()[2:]] == [
        "ddp_notebook, fork server (default)", "ddp_notebook, fork server started by `%load_ext`",
        "torch.multiprocessing fork"]
    for row in relaunch.splitlines()[2:]:  # hung runs: none of ours; torch.multiprocessing fork's, counted
        hung = row.split("|")[-2].strip()
        assert re.fullmatch(r"\d+ of 10", hung) and (hung == "0 of 10" or not ours(row)), relaunch
    data_rows = data.splitlines()[2:]
    assert [row.split("|")[1].strip() for row in data_rows] == [
        "floor: one copy into fresh shared memory, read by waiting processes (no launcher)",
        "ddp_notebook (fork server warm)", "ddp_notebook, data from `ddp_notebook.share`"] * 2  # 1 MB, then 64 MB
    measured_or_hung(data_rows, 4)
    assert [row.split("|")[1].strip() for row in result.splitlines()[2:]] == [
        "ddp_notebook (fork server warm)", "torch.multiprocessing fork"]
    assert [row.split("|")[1].strip() for row in trackers.splitlines()[2:]] == [
        "none", "TensorBoard and MLflow (report_to)"]
    assert trackers.splitlines()[-1].endswith("| 120 of 120 |")  # every value reached MLflow
    assert comparison.splitlines()[2].startswith("| ddp_notebook.compare(last=5) | ")
    measured_or_hung(result.splitlines()[2:], 2)
