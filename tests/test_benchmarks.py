"""The benchmark suite's quick mode, as a smoke test (no timing assertions)."""
import os
import subprocess
import sys

BENCH = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "launch_bench.py")


def test_launch_benchmark_quick_mode_prints_its_table():
    out = subprocess.run([sys.executable, BENCH, "--quick"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 5 and rows[1].startswith("| ddp_notebook, pool off |")  # header + 4 launchers
    assert all(len(r.split("|")) == 9 for r in rows)


def test_fit_benchmark_quick_mode_prints_its_table():
    bench = os.path.join(os.path.dirname(BENCH), "fit_bench.py")
    out = subprocess.run([sys.executable, bench, "--quick"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 4 and rows[-1].endswith("| 1.00x |")
