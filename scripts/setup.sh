#!/usr/bin/env bash
# Creates .venv and installs ddp_notebook with its test tools. Safe to run again.
# torch is pinned to 2.13.0: the CPU build this project is developed and tested with
# (an unpinned torch would download a multi-GB CUDA build).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
quiet() { "$@" 2> >(grep -v "^WARNING: Location" >&2); }
quiet .venv/bin/pip install -q --disable-pip-version-check torch==2.13.0
quiet .venv/bin/pip install -q --disable-pip-version-check -e ".[test]"
