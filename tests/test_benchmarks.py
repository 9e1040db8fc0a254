"""The benchmark suite's quick mode, as a smoke test (no timing assertions): each script of
``benchmarks/run.py`` a test of its own, checking its own tables."""
import os
import re
import runpy
import subprocess
import sys

import pytest

pytestmark = pytest.mark.processes

HERE = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
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


def names(table):
    return [row.split("|")[1].strip() for row in table.splitlines()[2:]]


def check_launch(out, launch):
    assert names(launch) == ["ddp_notebook, fork server started by the launch", "torch.multiprocessing fork"]
    assert all(len(row.split("|")) == 9 for row in launch.splitlines())


def check_fit(out, fit):
    assert fit.splitlines()[-1].endswith("| 1.00x |")


def check_overhead(out, overhead):
    assert overhead.splitlines()[2].startswith("| none |") and "ctx.log itself costs" in out


def check_reliability(out, reliability):
    assert reliability.splitlines()[2].startswith("| ddp_notebook | 4 | 0 | 0 |")  # 4 clean runs, none lost


def check_engines(out, engines):
    assert names(engines) == ["ipyparallel engines (warm), ddp_notebook", "local workers, ddp_notebook fork server",
                              "torch.multiprocessing fork"]


def check_relaunch(out, relaunch):
    assert names(relaunch) == ["ddp_notebook, fork server (default)", "ddp_notebook, fork server started by `%load_ext`",
                               "torch.multiprocessing fork"]
    for row in relaunch.splitlines()[2:]:  # hung runs: none of ours; torch.multiprocessing fork's, counted
        hung = row.split("|")[-2].strip()
        assert re.fullmatch(r"\d+ of 10", hung) and (hung == "0 of 10" or not ours(row)), relaunch


def check_data(out, data, result):
    assert names(data) == ["floor: one copy into fresh shared memory, read by waiting processes (no launcher)",
                           "ddp_notebook (fork server warm)", "ddp_notebook, data from `ddp_notebook.share`"] * 2
    measured_or_hung(data.splitlines()[2:], 4)  # 1 MB, then 64 MB
    assert names(result) == ["ddp_notebook (fork server warm)", "torch.multiprocessing fork"]
    measured_or_hung(result.splitlines()[2:], 2)


def check_experiments(out, trackers, comparison):
    assert names(trackers) == ["none", "TensorBoard and MLflow (report_to)"]
    assert trackers.splitlines()[-1].endswith("| 120 of 120 |")  # every value reached MLflow
    assert comparison.splitlines()[2].startswith("| ddp_notebook.compare(last=5) | ")


def check_first_error(out, first_error):
    assert names(first_error) == ["`ddp_notebook.launch` (+ `wait()`)", "accelerate `notebook_launcher`"]
    assert "main worker (cpu:0) failed: ValueError: rank 0 raised" in first_error.splitlines()[2]


CHECKS = {"launch_bench.py": check_launch, "fit_bench.py": check_fit, "overhead_bench.py": check_overhead,
          "reliability_bench.py": check_reliability, "engines_bench.py": check_engines,
          "relaunch_bench.py": check_relaunch, "data_bench.py": check_data,
          "experiments_bench.py": check_experiments, "first_error_bench.py": check_first_error}


def test_every_script_of_the_suite_is_smoke_tested():
    assert set(runpy.run_path(os.path.join(HERE, "run.py"))["SUITE"]) == set(CHECKS)


@pytest.mark.parametrize("script", sorted(CHECKS))
def test_a_benchmark_in_smoke_mode_prints_its_tables(script):
    # --smoke is --quick without the rows that only add fresh interpreters (torch.multiprocessing
    # spawn, the warm pool without a fork server) or a known hang's minute (fork on the data
    # benchmark): every table, in a third of the time.
    out = subprocess.run([sys.executable, os.path.join(HERE, script), "--smoke"], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr
    tables = [block for block in out.stdout.split("\n\n") if block.startswith("| ")]
    check = CHECKS[script]
    assert len(tables) == check.__code__.co_argcount - 1, out.stdout
    check(out.stdout, *tables)
