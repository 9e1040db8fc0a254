#!/usr/bin/env bash
# Sets everything up and runs the whole test suite (extra arguments go to pytest), on two
# processes (pytest-xdist, a test file each at a time, the longest first: much of the suite waits
# on kernels, browsers and timeouts); -n 0 runs it in one.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=30 "$@"
