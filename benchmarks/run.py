"""The whole benchmark suite, one command; prints each table (markdown):

    .venv/bin/python benchmarks/run.py            # full (about 35 minutes on 2 cores)
    .venv/bin/python benchmarks/run.py --quick    # one short trial of each
    .venv/bin/python benchmarks/run.py --smoke    # --quick without the rows that only add fresh
                                                  # interpreters (the CI smoke test)
"""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
SUITE = ("launch_bench.py", "fit_bench.py", "overhead_bench.py", "reliability_bench.py", "engines_bench.py",
         "relaunch_bench.py", "data_bench.py", "experiments_bench.py", "first_error_bench.py")

if __name__ == "__main__":
    failed = 0
    for script in SUITE:
        done = subprocess.run([sys.executable, os.path.join(HERE, script), *sys.argv[1:]])
        failed += done.returncode != 0
        print(flush=True)
    sys.exit(1 if failed else 0)
